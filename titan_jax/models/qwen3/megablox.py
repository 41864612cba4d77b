"""The experts' SwiGLU on TPU by the Pallas megablox grouped matmul (`gmm`, whose own VJP is
`gmm` for the rows and `tgmm` for the weights), as MaxText runs it.

Why not `jax.lax.ragged_dot` there: XLA:TPU lowers its weight gradient as a dense masked
convolution over every expert and the whole row buffer (a `select` of experts x rows x dim),
so the buffer's padding rows, and every row for every expert, are computed in backward. The
kernels visit only the row tiles the group sizes cover.

Rows past the groups (an exchange buffer's padding) are one more group that no expert's weight
covers: megablox zero-fills the rows of groups it does not compute, so they come back zero,
as with `ragged_dot`. A Pallas kernel is opaque to the partitioner, so it runs through the
`run_per_shard` hook: on each device's rows, with the experts' hidden (FFN) dim split over tp
as the rules table splits "mlp"; each tp shard returns its partial sum of the output, summed
outside the kernel (what the partitioner does for `ragged_dot` split over tp).

Quantized experts (`[quantize]` with `experts`) run tokamax's Mosaic TPU grouped matmul instead,
whose operands qwix quantizes to int8 or fp8 e4m3 with a scale per row and per expert output
column, forward and in both backward products (the incoming gradient per row as well: e4m3, not
e5m2, for fp8; tokamax's kernel takes one type), in the same per-shard call. Experts FSDP
gathers as codes (`quantize.gather = "auto"`: `PrequantizedWeight`, scaled per expert and
output column as tokamax scales them) go in as they are (`_gmm_codes`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from titan_jax.models.quantization import PrequantizedWeight
from titan_jax.models.qwen3.adapter import (
    AdaptedExperts,
    adapted_matmul,
    adapted_matmul_pair,
    distinct_leaves,
)
from titan_jax.models.sharding_hooks import LogicalAxes, run_per_shard

if TYPE_CHECKING:
    from qwix._src.core.qarray import QArray

Array = jax.Array
# An expert weight as the kernels read it: cast and gathered, gathered as codes, or with a LoRA
# adapter beside it.
ExpertWeight = Array | PrequantizedWeight | AdaptedExperts
# Tile sizes tried largest first, per dim: each must divide its dim (else the whole dim is one
# tile). MaxText's v5p/v6e tiles are 512 rows x 1024.
ROW_TILES = (512, 256, 128, 64, 32, 16, 8)
DIM_TILES = (1024, 512, 256, 128)
ROWS_AXES = (None, None)
EXPERT_IN_AXES = ("expert", "moe_embed", "mlp")
EXPERT_OUT_AXES = ("expert", "mlp", "moe_embed")


def _tile(size: int, tiles: tuple[int, ...]) -> int:
    return next((t for t in tiles if size % t == 0), size)


def tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for one kernel call: megablox asks per call (its backward's `gmm` and
    `tgmm` contract other dims than the forward), and a TPU block's last two dims must be
    multiples of (8, 128) or whole."""
    return _tile(m, ROW_TILES), _tile(k, DIM_TILES), _tile(n, DIM_TILES)


def _gmm(lhs_MK: Array, rhs_EKN: Array, group_sizes: Array, interpret: bool) -> Array:
    from jax.experimental.pallas.ops.tpu import megablox

    return megablox.gmm(lhs_MK, rhs_EKN, group_sizes, lhs_MK.dtype, tiling, interpret=interpret)


def _quantized_gmm(
    lhs_MK: Array,
    rhs_EKN: Array | PrequantizedWeight,
    group_sizes: Array,
    qdtype: str,
    interpret: bool,
) -> Array:
    """tokamax's grouped matmul on `qdtype` operands (its VJP quantizes the backward's), or on
    experts gathered as codes (`sharding_hooks.use_param`), which it takes as they are (scaled
    per expert and output column, as it scales them: `Quantization.expert_weight`).
    `group_sizes` ends with the padding rows' group, which tokamax cannot take (its weight
    gradient would have a group more than the weights): the experts' groups go in, and the
    rows past them, which it leaves unwritten, are selected out of its output and, by the
    select on its input, of its input gradient."""
    sizes = group_sizes[:-1]
    held_M1 = (jnp.arange(lhs_MK.shape[0]) < jnp.sum(sizes))[:, None]
    lhs_MK = jnp.where(held_M1, lhs_MK, 0)
    if isinstance(rhs_EKN, PrequantizedWeight):
        out = _gmm_codes(lhs_MK, rhs_EKN.port, rhs_EKN.codes, sizes, qdtype, interpret)
    else:
        kernel = _tokamax_kernel(qdtype, interpret)
        out = kernel(lhs_MK, rhs_EKN, group_sizes=sizes, preferred_element_type=lhs_MK.dtype)
    return jnp.where(held_M1, out, 0)


def _tokamax_kernel(qdtype: str, interpret: bool) -> Callable[..., Array]:
    from tokamax._src.ops.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot

    return PallasMosaicTpuRaggedDot(qdtype=qdtype, interpret=interpret)


# Hand-written VJP: tokamax's own backward (its `vjp`, the same kernel for both products) with
# the weight's gradient sent to the port: tokamax's has no cotangent for a QArray's codes.
# Without it: tests/models/test_quantization.py::
# test_tpu_experts_gathered_as_codes_run_as_the_kernel_quantizes_them
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gmm_codes(
    lhs_MK: Array, port: Array, codes: QArray, sizes: Array, qdtype: str, interpret: bool
) -> Array:
    return _gmm_codes_fwd(lhs_MK, port, codes, sizes, qdtype, interpret)[0]


def _gmm_codes_fwd(
    lhs_MK: Array, port: Array, codes: QArray, sizes: Array, qdtype: str, interpret: bool
) -> tuple[Array, tuple]:
    kernel = _tokamax_kernel(qdtype, interpret)
    out = kernel(lhs_MK, codes, group_sizes=sizes, preferred_element_type=lhs_MK.dtype)
    return out, (lhs_MK, port, codes, sizes)


def _gmm_codes_bwd(qdtype: str, interpret: bool, residuals: tuple, g: Array) -> tuple:
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_tpu

    lhs_MK, port, codes, sizes = residuals
    kernel = _tokamax_kernel(qdtype, interpret)

    def product(lhs: Array | QArray, rhs: Array | QArray, dims: object, like: Array) -> Array:
        """One backward product, typed as `like`'s cotangent."""
        return kernel(
            lhs,
            rhs,
            group_sizes=sizes,
            ragged_dot_dimension_numbers=dims,
            preferred_element_type=like.dtype,
            manual_axis_type=jax.typeof(like).manual_axis_type.to_ct_mat(),
        )

    # tokamax's `vjp`, whose dtype and type reads a QArray does not answer: the rows' gradient
    # is the incoming gradient, scaled by the codes' scales, times the codes; the weight's is
    # the rows times the incoming gradient, as for a weight handed it unquantized.
    d_lhs = product(g, codes, tokamax_tpu.DLHS_RAGGED_DOT_DIM_NUMS, lhs_MK)
    d_rhs = product(lhs_MK, g, tokamax_tpu.DRHS_RAGGED_DOT_DIM_NUMS, port)
    return d_lhs, d_rhs, None, None


_gmm_codes.defvjp(_gmm_codes_fwd, _gmm_codes_bwd)


# Hand-written VJP: megablox's own reads A and writes its gradient as A is laid out, (E, in, r),
# the rank minor: TPU tiles pad a minor dim of 16 to 128 lanes, and the layer scan's stacked
# fp32 adapter gradients took that layout, 8x their size. This one hands the kernels A as
# (E, r, in), the input dim minor (forward and the rows' gradient read it so, tgmm writes its
# gradient so), and transposes (docs/notes/2026-12-07-lora-expert-adapters.md). Without it:
# tests/parallel/test_posttraining_recipes_aot.py::
# test_posttraining_recipe_compiles_and_fits[configs/qwen3_30b_a3b_lora.toml-v5p-8]
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rank_gmm(x_MK: Array, a_EKR: Array, group_sizes: Array, interpret: bool) -> Array:
    return _rank_gmm_fwd(x_MK, a_EKR, group_sizes, interpret)[0]


def _megablox_kernels() -> Any:
    # The module, not the package's `gmm` (which is the function).
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _rank_gmm_fwd(
    x_MK: Array, a_EKR: Array, group_sizes: Array, interpret: bool
) -> tuple[Array, tuple[Array, Array, Array]]:
    a_ERK = a_EKR.swapaxes(1, 2)
    out = _megablox_kernels().gmm(
        x_MK, a_ERK, group_sizes, x_MK.dtype, tiling, transpose_rhs=True, interpret=interpret
    )
    return out, (x_MK, a_ERK, group_sizes)


def _rank_gmm_bwd(
    interpret: bool, saved: tuple[Array, Array, Array], g_MR: Array
) -> tuple[Array, Array, None]:
    kernels = _megablox_kernels()
    x_MK, a_ERK, sizes = saved
    dx_MK = kernels.gmm(g_MR, a_ERK, sizes, x_MK.dtype, tiling, interpret=interpret)
    da_ERK = kernels.tgmm(
        g_MR.T,
        x_MK,
        sizes,
        a_ERK.dtype,
        tiling,
        num_actual_groups=a_ERK.shape[0],
        interpret=interpret,
    )
    return dx_MK, da_ERK.swapaxes(1, 2), None


_rank_gmm.defvjp(_rank_gmm_fwd, _rank_gmm_bwd)


def _swiglu_partial_sum(
    x_MD: Array,
    w1_EDF: ExpertWeight,
    w3_EDF: ExpertWeight,
    w2_EFD: ExpertWeight,
    group_sizes: Array,
    matmuls: tuple[Callable[..., Array], Callable[..., Array], Callable[..., Array]],
) -> Array:
    """One tp shard's SwiGLU (its slice of the hidden dim): (1, M, D), its partial sum (a LoRA
    adapter's term too: its products are linear in the hidden dim's slices). `matmuls`: the
    grouped matmul of the weights, then a LoRA adapter's (`adapted_matmul`)."""
    gate_MF, up_MF = adapted_matmul_pair(matmuls, x_MD, (w1_EDF, w3_EDF), group_sizes)
    return adapted_matmul(*matmuls, jax.nn.silu(gate_MF) * up_MF, w2_EFD, group_sizes)[None]


def _leaf_axes(leaf: Array, arg: Array | PrequantizedWeight, axes: LogicalAxes) -> LogicalAxes:
    """The logical axes of one array of `arg` (itself, or a prequantized weight's codes, scales
    or port): `axes`, but None for a dim of size 1 where the weight's is larger (a scale's)."""
    return tuple(
        a if n == whole else None for a, n, whole in zip(axes, leaf.shape, arg.shape, strict=True)
    )


def _arg_leaf_axes(arg: Any, axes: LogicalAxes) -> tuple[LogicalAxes, ...]:
    """The logical axes of each array of one kernel argument, in `jax.tree.leaves` order."""
    if isinstance(arg, AdaptedExperts):
        return (*_arg_leaf_axes(arg.base, axes), *AdaptedExperts.leaf_axes(axes))
    return tuple(_leaf_axes(leaf, arg, axes) for leaf in jax.tree.leaves(arg))


def megablox_swiglu(
    x_MD: Array,
    w1_EDF: ExpertWeight,
    w3_EDF: ExpertWeight,
    w2_EFD: ExpertWeight,
    group_sizes_E: Array,
    interpret: bool = False,
    qdtype: str | None = None,
) -> Array:
    """Rows sorted by expert through their expert's SwiGLU; rows past sum(group_sizes) zero.
    `interpret`: Pallas interpret mode (tests on CPU). `qdtype`: "int8" or "float8_e4m3fn"
    operands, by tokamax's kernel (None: bf16, by megablox's); a LoRA adapter's products are
    megablox's, unquantized."""
    padding = x_MD.shape[0] - jnp.sum(group_sizes_E)
    sizes = jnp.concatenate([group_sizes_E, padding[None]]).astype(jnp.int32)
    if qdtype is None:
        gmm = functools.partial(_gmm, interpret=interpret)
    else:
        gmm = functools.partial(_quantized_gmm, qdtype=qdtype, interpret=interpret)
    args = (x_MD, w1_EDF, w3_EDF, w2_EFD, sizes)
    axes = (ROWS_AXES, EXPERT_IN_AXES, EXPERT_IN_AXES, EXPERT_OUT_AXES, (None,))
    # Experts gathered as codes go in as their arrays (codes, scales, port), each with its
    # weight's axes but for the dims its scales span (size 1, never split); a LoRA adapter's
    # A and B with the weight's, but for their rank dim.
    leaves, tree = jax.tree.flatten(args)
    leaf_axes = tuple(
        leaf_axes
        for arg, arg_axes in zip(args, axes, strict=True)
        for leaf_axes in _arg_leaf_axes(arg, arg_axes)
    )
    # Each array goes in once (a joined adapter's A: `distinct_leaves`).
    firsts, positions = distinct_leaves(leaves)
    # A LoRA adapter's products: megablox's, unquantized, the first with A rank-major.
    matmuls = (
        gmm,
        functools.partial(_rank_gmm, interpret=interpret),
        functools.partial(_gmm, interpret=interpret),
    )

    def kernel(*distinct: Array) -> Array:
        args = jax.tree.unflatten(tree, [distinct[i] for i in positions])
        return _swiglu_partial_sum(*args, matmuls=matmuls)

    partials = run_per_shard(
        kernel,
        tuple(leaves[i] for i in firsts),
        tuple(leaf_axes[i] for i in firsts),
        ("mlp", None, None),
    )
    # Selective remat can keep the output; gate and up stay inside the kernel call, recomputed.
    return checkpoint_name(jnp.sum(partials, axis=0).astype(x_MD.dtype), "moe_w2")
