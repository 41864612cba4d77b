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
e5m2, for fp8; tokamax's kernel takes one type), in the same per-shard call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from titan_jax.models.sharding_hooks import run_per_shard

Array = jax.Array
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
    lhs_MK: Array, rhs_EKN: Array, group_sizes: Array, qdtype: str, interpret: bool
) -> Array:
    """tokamax's grouped matmul on `qdtype` operands (its VJP quantizes the backward's).
    `group_sizes` ends with the padding rows' group, which tokamax cannot take (its weight
    gradient would have a group more than the weights): the experts' groups go in, and the
    rows past them, which it leaves unwritten, are selected out of its output and, by the
    select on its input, of its input gradient."""
    from tokamax._src.ops.ragged_dot.pallas_mosaic_tpu import PallasMosaicTpuRaggedDot

    sizes = group_sizes[:-1]
    held_M1 = (jnp.arange(lhs_MK.shape[0]) < jnp.sum(sizes))[:, None]
    kernel = PallasMosaicTpuRaggedDot(qdtype=qdtype, interpret=interpret)
    out = kernel(
        jnp.where(held_M1, lhs_MK, 0),
        rhs_EKN,
        group_sizes=sizes,
        preferred_element_type=lhs_MK.dtype,
    )
    return jnp.where(held_M1, out, 0)


def _swiglu_partial_sum(
    x_MD: Array,
    w1_EDF: Array,
    w3_EDF: Array,
    w2_EFD: Array,
    group_sizes: Array,
    gmm: Callable[..., Array],
) -> Array:
    """One tp shard's SwiGLU (its slice of the hidden dim): (1, M, D), its partial sum."""
    gmm = functools.partial(gmm, group_sizes=group_sizes)
    h_MF = jax.nn.silu(gmm(x_MD, w1_EDF)) * gmm(x_MD, w3_EDF)
    return gmm(h_MF, w2_EFD)[None]


def megablox_swiglu(
    x_MD: Array,
    w1_EDF: Array,
    w3_EDF: Array,
    w2_EFD: Array,
    group_sizes_E: Array,
    interpret: bool = False,
    qdtype: str | None = None,
) -> Array:
    """Rows sorted by expert through their expert's SwiGLU; rows past sum(group_sizes) zero.
    `interpret`: Pallas interpret mode (tests on CPU). `qdtype`: "int8" or "float8_e4m3fn"
    operands, by tokamax's kernel (None: bf16, by megablox's)."""
    padding = x_MD.shape[0] - jnp.sum(group_sizes_E)
    sizes = jnp.concatenate([group_sizes_E, padding[None]]).astype(jnp.int32)
    gmm = (
        functools.partial(_gmm, interpret=interpret)
        if qdtype is None
        else functools.partial(_quantized_gmm, qdtype=qdtype, interpret=interpret)
    )
    partials = run_per_shard(
        functools.partial(_swiglu_partial_sum, gmm=gmm),
        (x_MD, w1_EDF, w3_EDF, w2_EFD, sizes),
        (ROWS_AXES, EXPERT_IN_AXES, EXPERT_IN_AXES, EXPERT_OUT_AXES, (None,)),
        ("mlp", None, None),
    )
    # Selective remat can keep the output; gate and up stay inside the kernel call, recomputed.
    return checkpoint_name(jnp.sum(partials, axis=0).astype(x_MD.dtype), "moe_w2")
