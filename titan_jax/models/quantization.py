"""Low-precision matmuls (`[quantize]`): fp8 or int8 operands, quantized by qwix, forward and
backward, as quantization-aware training does it.

- fp8: e4m3 operands forward, e5m2 incoming gradients backward (TorchTitan's float8 and
  MaxText's `fp8_full` recipe); int8: int8 both ways (AQT/qwix int8 training on v5e-v6e).
- Scales are computed from the operands each step ("current" scaling, qwix's `absmax`):
  `rowwise` one scale per row of each operand (per output channel of a weight), `tensorwise`
  one per operand, `blockwise` one per `block_size` slice of the contracted dimension too.
- The weights stay fp32 masters: each matmul quantizes the gathered weight it reads, so
  optimizer state, checkpoints and HF exports do not change. What is quantized is chosen per
  group of matmuls (`quantize.modules`); the router, norms, attention's own score and value products
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
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir as _mlir_internals
from jax.interpreters import mlir

if TYPE_CHECKING:
    from qwix._src.core.dot_general_qt import DotGeneralQtConfig
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

    def kernel_qtype(self) -> str:
        """The one operand type of a kernel that quantizes forward and backward alike
        (tokamax's TPU grouped matmul): the forward's."""
        return jnp.dtype(QTYPES[self.mode][0]).name

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


_XLA_REDUCE_PRECISION = _mlir_internals._lowerings[jax.lax.reduce_precision_p].rule


def _lower_reduce_precision(
    ctx: mlir.LoweringRuleContext, operand: mlir.ir.Value, *, exponent_bits: int, mantissa_bits: int
) -> list[mlir.ir.Value]:
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
    dtype = ctx.avals_in[0].dtype
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        info = jnp.finfo(dtype)
        if (exponent_bits, mantissa_bits) == (info.nexp, info.nmant):
            return [operand]
    return _XLA_REDUCE_PRECISION(
        ctx, operand, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits
    )


mlir.register_lowering(jax.lax.reduce_precision_p, _lower_reduce_precision)


def dot(
    x: Array,
    w: Array,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig | None,
) -> Array:
    """`jax.lax.dot_general(x, w, dimension_numbers)`, quantized when `config` says so; the
    result is in x's dtype either way."""
    if config is None:
        return jax.lax.dot_general(x, w, dimension_numbers)
    from qwix._src.core.dot_general_qt import dot_general_qt

    return dot_general_qt(x, w, dimension_numbers, config)


def ragged_dot(
    x_MD: Array, w_EDF: Array, group_sizes_E: Array, config: RaggedDotQtConfig | None
) -> Array:
    """`jax.lax.ragged_dot`, quantized when `config` says so, in x's dtype."""
    if config is None:
        return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E)
    from qwix._src.core.ragged_dot_qt import ragged_dot_qt

    return ragged_dot_qt(x_MD, w_EDF, group_sizes_E, config, preferred_element_type=x_MD.dtype)
