"""Low-precision matmuls (`[quantize]`): fp8 or int8 operands, quantized by qwix, forward and
backward, as quantization-aware training does it.

- fp8: e4m3 operands forward, e5m2 incoming gradients backward (TorchTitan's float8 and
  MaxText's `fp8_full` recipe); int8: int8 both ways (AQT/qwix int8 training on v5e-v6e).
- Scales are computed from the operands each step ("current" scaling, qwix's `absmax`):
  `rowwise` one scale per row of each operand (per output channel of a weight), `tensorwise`
  one per operand, `blockwise` one per `block_size` slice of the contracted dimension too.
- The weights stay fp32 masters: each matmul reads its weight quantized, so optimizer state,
  checkpoints and HF exports do not change. Under FSDP the weight is quantized where it is
  stored and gathered as its codes and scales (`quantize.gather = "auto"`, as torchao's
  float8 all-gather): each shard's scales are the whole weight's (a max over the data shards
  of the scaled dims' partial maxima), so the codes are the ones quantizing the gathered
  weight would give, the gather moves one byte per element, and the matmul takes them as they
  are (`PrequantizedWeight`, `dot`). Its gradient is the one with respect to the dequantized
  weight (straight-through, as qwix's quantized training has it), reduced in fp32 by the
  gather's backward as any weight's. `blockwise` scaling gathers the param dtype: qwix's
  backward re-reads a tiled weight unquantized. What is quantized is chosen per group of
  matmuls (`quantize.modules`); the router, norms, attention's own score and value products
  and the loss's output projection stay in the parameter dtype.

qwix's quantized-training primitives (`dot_general_qt`, `ragged_dot_qt`, what its `QtProvider`
puts in place of `jax.lax.dot_general` / `ragged_dot`) are called directly: the model's
matmuls are already one function each (`model.project`, `moe.grouped_swiglu`), and module-path
interception would not see through the layer scan's merged module state. They live in qwix's
`_src` (qwix 0.1.8, pinned in pyproject.toml), imported where a matmul is quantized: a stack
without qwix (the lent GPU machine's, benchmarks/gpu.sh) runs everything else.

Importing this module also makes `reduce_precision` of an fp8 value to its own format the
identity (`_lower_reduce_precision`): jax's remat inserts that op on every saved fp8 value,
and XLA's IEEE reading of it turned e4m3fn's top binade into NaN.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir as _mlir_internals
from jax.interpreters import mlir

if TYPE_CHECKING:
    from collections.abc import Sequence

    from qwix._src.core.dot_general_qt import DotGeneralQtConfig
    from qwix._src.core.qarray import QArray
    from qwix._src.core.ragged_dot_qt import RaggedDotQtConfig

Array = jax.Array

# (forward operands, incoming gradients) per mode.
QTYPES = {"fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2), "int8": (jnp.int8, jnp.int8)}


@dataclasses.dataclass(frozen=True)
class Quantization:
    """Which matmuls run in which low precision (none by default)."""

    mode: str = "none"
    modules: tuple[str, ...] = ()  # of config_schema.QUANTIZE_MODULES
    scaling: str = "rowwise"
    block_size: int = 128  # contracted elements per scale under "blockwise"
    gather: str = "auto"  # `quantize.gather`: "auto" (codes, see the module doc) or "param_dtype"

    def applies_to(self, module: str) -> bool:
        return self.mode != "none" and module in self.modules

    def dot_config(self, module: str) -> DotGeneralQtConfig | None:
        """qwix's config for `module`'s dense matmuls; None where they stay unquantized."""
        if not self.applies_to(module):
            return None
        from qwix._src.core.dot_general_qt import DotGeneralQtConfig

        forward, gradient = QTYPES[self.mode]
        tensorwise = self.scaling == "tensorwise"
        tile = self.block_size if self.scaling == "blockwise" else None
        return DotGeneralQtConfig(
            lhs_qtype=forward,
            rhs_qtype=forward,
            tile_size=tile,
            lhs_disable_channelwise_axes=tensorwise,
            rhs_disable_channelwise_axes=tensorwise,
            dlhs_grad_qtype=gradient,
            drhs_grad_qtype=gradient,
            dlhs_tile_size=tile,
            drhs_tile_size=tile,
            dlhs_grad_disable_channelwise_axes=tensorwise,
            drhs_grad_disable_channelwise_axes=tensorwise,
        )

    def quantized_dot(self, module: str) -> QuantizedDot | None:
        """How `module`'s dense matmuls read and multiply their weights; None where they stay
        unquantized."""
        config = self.dot_config(module)
        if config is None:
            return None
        gathered = self.gather == "auto" and self.scaling != "blockwise"
        return QuantizedDot(config, gathered)

    def kernel_qtype(self) -> str:
        """The one operand type of a kernel that quantizes forward and backward alike
        (tokamax's TPU grouped matmul): the forward's."""
        return jnp.dtype(QTYPES[self.mode][0]).name

    def expert_weight(self, kernel: str, mlp_split: int = 1) -> WeightQuantization | None:
        """How `kernel` (`moe.EXPERT_KERNELS`) quantizes the experts' (E, in, out) weights,
        where they are to arrive quantized (`quantize.gather = "auto"`; else None: the kernel
        quantizes them). A scale per output column either way (`scaling` does not apply to
        the experts), shared by the experts in qwix's `ragged_dot` (CPU, GPU), one per expert
        in tokamax's TPU kernel ("megablox"). Not for tokamax's under tp (`mlp_split` > 1): it
        scales each tp shard's slice of w2's hidden dim on its own, after the gather."""
        if not self.applies_to("experts") or self.gather != "auto":
            return None
        if kernel == "megablox" and mlp_split > 1:
            return None
        return WeightQuantization(
            jnp.dtype(QTYPES[self.mode][0]), 2, True, per_expert=kernel == "megablox"
        )

    def ragged_config(self) -> RaggedDotQtConfig | None:
        """qwix's config for the experts' grouped matmuls (rowwise: a scale per row of the
        tokens, and per output column of the weights, shared by the experts)."""
        if not self.applies_to("experts"):
            return None
        from qwix._src.core.ragged_dot_qt import RaggedDotQtConfig

        forward, gradient = QTYPES[self.mode]
        return RaggedDotQtConfig(
            lhs_qtype=forward, rhs_qtype=forward, dlhs_grad_qtype=gradient, drhs_grad_qtype=gradient
        )


NONE = Quantization()


@dataclasses.dataclass(frozen=True)
class WeightQuantization:
    """How a matmul contracting a weight's first `contracted` dims quantizes it: to `qtype`,
    with one absmax scale per index of its other dims (`rowwise`, qwix's channelwise: per
    output channel) or one for the whole weight. A grouped matmul's weight (E, in, out) counts
    its expert dim as contracted where all experts share each output column's scale (qwix's
    `ragged_dot`), and keeps a scale per expert too where `per_expert` (tokamax's kernel)."""

    qtype: jnp.dtype
    contracted: int
    rowwise: bool
    per_expert: bool = False

    def scaled_dims(self, ndim: int) -> tuple[int, ...]:
        """The dims of a weight of `ndim` dims with a scale per index."""
        outputs = tuple(range(self.contracted, ndim)) if self.rowwise else ()
        return ((0,) if self.per_expert else ()) + outputs

    def quantize(self, w: Array, max_over_shards: Callable[[Array], Array]) -> QArray:
        """`w` (one shard of the weight, in the compute dtype) quantized with the whole
        weight's scales: `max_over_shards` takes this shard's absmax per scale (the scaled dims
        kept, the others size 1) to the max over the shards that split the others. qwix's own
        scale and rounding, so the codes are those `dot_general_qt` gives the whole weight."""
        from qwix._src.core import qarray

        scaled = self.scaled_dims(w.ndim)
        reduced = tuple(d for d in range(w.ndim) if d not in scaled)
        absmax = max_over_shards(jnp.max(jnp.abs(w), axis=reduced, keepdims=True))
        scale, _ = qarray.compute_scale_zero_point({"absmax": absmax}, self.qtype)
        return qarray.quantize_with_scale_zero_point(w, self.qtype, scale, None)


@dataclasses.dataclass(frozen=True)
class QuantizedDot:
    """A dense matmul's quantization: qwix's `config`, and whether its weight arrives
    quantized (`gathered`: `quantize.gather = "auto"` outside blockwise scaling)."""

    config: DotGeneralQtConfig
    gathered: bool

    def weight(self, n_in: int) -> WeightQuantization | None:
        """How the matmul contracting a weight's first `n_in` dims quantizes it, where the
        weight is to arrive quantized (else None: the matmul quantizes it)."""
        if not self.gathered:
            return None
        rowwise = not self.config.rhs_disable_channelwise_axes
        return WeightQuantization(jnp.dtype(self.config.rhs_qtype), n_in, rowwise)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrequantizedWeight:
    """A trained weight as a quantized matmul reads it: its codes and scales (`codes`, qwix's
    QArray) and `port`, zeros of the weight's shape and compute dtype that the forward never
    reads: its cotangent is the gradient with respect to the dequantized weight, which the
    weight read's backward reduces (the gather's, as for a weight read unquantized)."""

    codes: QArray
    port: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.port.shape

    def reshape(self, *shape: int) -> PrequantizedWeight:
        return PrequantizedWeight(self.codes.reshape(*shape), self.port.reshape(*shape))


_XLA_REDUCE_PRECISION = _mlir_internals._lowerings[jax.lax.reduce_precision_p].rule


def _lower_reduce_precision(
    ctx: mlir.LoweringRuleContext, operand: mlir.ir.Value, *, exponent_bits: int, mantissa_bits: int
) -> Sequence[mlir.ir.Value | Sequence[mlir.ir.Value]]:
    """`reduce_precision` that leaves a float8 value reduced to its own format as it is.

    jax's remat (`ad_checkpoint._insert_reduce_precision`, jax 0.12) rounds every saved
    residual to `finfo(dtype)`'s bits against excess precision; for an fp8 residual (qwix's
    quantized operands, saved when the remat policy saves anything) that is
    `reduce_precision(x, 4, 3)` on an e4m3fn array. XLA reads those bits as an IEEE format
    with infinities, whose largest finite value is 240: e4m3fn's [256, 448], where absmax
    scaling puts each row's largest element, became NaN, and so did the loss at step 1
    (`activation_checkpoint.mode=none` with reshard_after_forward). An fp8 value holds no
    excess precision, so the identity is exact. Without it:
    tests/train/test_quantized_training.py::test_fp8_trains_the_debug_recipe_under_every_remat_mode.
    """
    aval = ctx.avals_in[0]
    if (
        isinstance(aval, jax.core.ShapedArray)
        and jnp.issubdtype(aval.dtype, jnp.floating)
        and aval.dtype.itemsize == 1
    ):
        info = jnp.finfo(aval.dtype)
        if (exponent_bits, mantissa_bits) == (info.nexp, info.nmant):
            return [operand]
    return _XLA_REDUCE_PRECISION(
        ctx, operand, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits
    )


mlir.register_lowering(jax.lax.reduce_precision_p, _lower_reduce_precision)


def dot(
    x: Array,
    w: Array | PrequantizedWeight,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig | None,
) -> Array:
    """`jax.lax.dot_general(x, w, dimension_numbers)`, quantized when `config` says so (a
    `PrequantizedWeight` is taken as it is quantized); the result is in x's dtype either way."""
    if isinstance(w, PrequantizedWeight):
        if config is None:
            raise ValueError("a weight gathered quantized is read by a quantized matmul only")
        return _dot_quantized_weight(x, w, dimension_numbers, config)
    if config is None:
        return jax.lax.dot_general(x, w, dimension_numbers)
    from qwix._src.core.dot_general_qt import dot_general_qt

    return dot_general_qt(x, w, dimension_numbers, config)


def _dot_quantized_weight(
    x: Array,
    w: PrequantizedWeight,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
) -> Array:
    """qwix's `dot_general_qt` with the weight's quantization already done: x is calibrated as
    qwix calibrates a left operand; forward and backward are qwix's own."""
    from qwix._src.core import dot_general, qarray

    how = dot_general.get_how_to_quantize(
        dimension_numbers=dimension_numbers,
        ndims=(x.ndim, w.codes.ndim),
        for_lhs=True,
        qtype=config.lhs_qtype,
        tile_size=config.tile_size,
        calibration_method=config.lhs_calibration_method,
    )
    if config.lhs_disable_channelwise_axes:
        how = dataclasses.replace(how, channelwise_axes=[])
    calibration = qarray.calibrate(x, how)
    return _dot_codes(x, w.port, w.codes, calibration, dimension_numbers, config)


# Hand-written VJP: the weight arrives as integer codes, which carry no gradient, so qwix's
# backward sends the weight's cotangent to the zero port beside them. Without it:
# tests/parallel/test_quantized_gather.py::
# test_quantized_gathers_equal_quantizing_after_the_gather
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dot_codes(
    x: Array,
    port: Array,
    codes: QArray,
    x_calibration: dict[str, Array],
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
) -> Array:
    return _dot_codes_fwd(x, port, codes, x_calibration, dimension_numbers, config)[0]


def _dot_codes_fwd(
    x: Array,
    port: Array,
    codes: QArray,
    x_calibration: dict[str, Array],
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
) -> tuple[Array, tuple]:
    from qwix._src.core.dot_general_qt import dot_general_qt_fwd

    del port  # only its cotangent matters
    return dot_general_qt_fwd(x, codes, x_calibration, None, dimension_numbers, config)


def _dot_codes_bwd(
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
    residuals: tuple,
    g: Array,
) -> tuple[Array, Array, None, None]:
    from qwix._src.core.dot_general_qt import dot_general_qt_bwd

    # The weight's gradient goes to the port (straight-through); codes and scales get none.
    dx, dw, *_ = dot_general_qt_bwd(dimension_numbers, residuals, g)
    return dx, dw, None, None


_dot_codes.defvjp(_dot_codes_fwd, _dot_codes_bwd)


def ragged_dot(
    x_MD: Array,
    w_EDF: Array | PrequantizedWeight,
    group_sizes_E: Array,
    config: RaggedDotQtConfig | None,
) -> Array:
    """`jax.lax.ragged_dot`, quantized when `config` says so (a `PrequantizedWeight` is taken
    as it is quantized), in x's dtype."""
    if isinstance(w_EDF, PrequantizedWeight):
        if config is None:
            raise ValueError("experts gathered quantized are read by a quantized matmul only")
        return _ragged_dot_codes(x_MD, w_EDF.port, w_EDF.codes, group_sizes_E, config)
    if config is None:
        return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E)
    from qwix._src.core.ragged_dot_qt import ragged_dot_qt

    return ragged_dot_qt(x_MD, w_EDF, group_sizes_E, config, preferred_element_type=x_MD.dtype)


# Hand-written VJP: qwix's `ragged_dot_qt` quantizes the weight itself, so its derivative
# cannot take gathered codes; this one sends the weight's gradient to the port. Without it:
# tests/parallel/test_quantized_gather.py::
# test_experts_gathered_as_codes_equal_quantizing_after_the_gather
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged_dot_codes(
    x_MD: Array, port: Array, codes: QArray, group_sizes_E: Array, config: RaggedDotQtConfig
) -> Array:
    return _ragged_dot_codes_fwd(x_MD, port, codes, group_sizes_E, config)[0]


def _ragged_dot_codes_fwd(
    x_MD: Array, port: Array, codes: QArray, group_sizes_E: Array, config: RaggedDotQtConfig
) -> tuple[Array, tuple]:
    from qwix._src.core import qarray
    from qwix._src.core import ragged_dot as qwix_ragged_dot

    del port  # only its cotangent matters
    # The rows as `ragged_dot_qt_fwd` quantizes them: a scale per row.
    rows = qarray.quantize(x_MD, qarray.HowToQuantize(qtype=config.lhs_qtype, channelwise_axes=[0]))
    y = qwix_ragged_dot.ragged_dot(rows, codes, group_sizes_E, None, x_MD.dtype, None)
    return y, (rows, codes, group_sizes_E)


def _ragged_dot_codes_bwd(
    config: RaggedDotQtConfig, residuals: tuple, g: Array
) -> tuple[Array, Array, None, None]:
    from qwix._src.core.ragged_dot_qt import ragged_dot_qt_bwd

    dx, dw, _ = ragged_dot_qt_bwd(config, None, g.dtype, None, residuals, g)
    return dx, dw, None, None


_ragged_dot_codes.defvjp(_ragged_dot_codes_fwd, _ragged_dot_codes_bwd)
