"""The experts' SwiGLU on CPU: rows sorted by expert, one loop over blocks of `BLOCK` rows.

XLA:CPU runs `ragged_dot` like a masked dense matmul over every group (BENCHMARKS.md, "CPU
kernel choices"), and a batched einsum over padded blocks needs every block's copy of its
expert's weights (blocks x D x F per projection, several times the weights themselves; 0.79 GB
of temporaries per layer at the debug MoE recipe's 8192 picks). Here a while loop visits only
the blocks the group sizes cover (each expert's rows in `ceil(size / BLOCK)` blocks; padding
rows past the groups are never visited and come out zero) and runs the whole SwiGLU of one
block against its expert's weights, read in place. Backward (a custom VJP that saves only the
inputs) loops the same way, recomputes the block's two input projections, and adds its weight
gradients into the expert's slice of one accumulator per weight: nothing per block outlives
its iteration.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
BLOCK = 32  # rows per block: measured fastest of 16/32/64/128 on this CPU at the debug shapes


class _Blocks:
    """Where block i starts in the sorted rows, its expert, and how many of its rows are real
    (the rest belong to the next group and are masked). `count`: the blocks in use."""

    def __init__(self, group_sizes_E: Array, m: int):
        e = group_sizes_E.shape[0]
        n_max = m // BLOCK + e  # sum_e ceil(size_e / BLOCK) never exceeds this
        per_group = -(-group_sizes_E // BLOCK)
        ends = jnp.cumsum(per_group)
        i = jnp.arange(n_max)
        # The group of each block by counting group ends at or before it (no searchsorted,
        # which fails inside shard_map).
        self.group = jnp.minimum(jnp.sum(ends[None, :] <= i[:, None], axis=1), e - 1)
        j = i - (ends - per_group)[self.group]  # the block's index within its group
        self.start = (jnp.cumsum(group_sizes_E) - group_sizes_E)[self.group] + j * BLOCK
        self.valid = jnp.clip(group_sizes_E[self.group] - j * BLOCK, 0, BLOCK)
        self.count = ends[-1]


def _varying_like(init: Array, *operands: Array) -> Array:
    """`init` varying over every manual mesh axis any operand varies over (inside shard_map a
    loop's carry must keep one type, and the loop body mixes the operands into it)."""
    varying = lambda a: jax.typeof(a).mat.varying  # noqa: E731
    axes = set().union(*map(varying, operands)) - varying(init)
    return lax.pcast(init, tuple(sorted(axes)), to="varying") if axes else init


class _Window(NamedTuple):
    """Block i's rows: the `BLOCK` rows from `first` (kept inside the array, so a group's last
    block may start early), of which those in [start, start + valid) are the group's."""

    first: Array
    real_R1: Array

    @classmethod
    def of(cls, blocks: _Blocks, i: Array, m: int) -> _Window:
        first = jnp.minimum(blocks.start[i], m - BLOCK)
        row_R1 = first + jnp.arange(BLOCK)[:, None]
        start = blocks.start[i]
        return cls(first, (row_R1 >= start) & (row_R1 < start + blocks.valid[i]))

    def rows(self, x: Array) -> Array:
        return lax.dynamic_slice_in_dim(x, self.first, BLOCK)

    def put(self, x: Array, rows: Array) -> Array:
        """`rows` written in the window, only where they are the group's."""
        return lax.dynamic_update_slice_in_dim(x, jnp.where(self.real_R1, rows, self.rows(x)),
                                               self.first, 0)


def looped_swiglu(x_MD: Array, w1_EDF: Array, w3_EDF: Array, w2_EFD: Array,
                  group_sizes_E: Array) -> Array:
    """`w2_e(silu(w1_e x) * w3_e x)` for each row x of group e (rows sorted by group); rows
    past sum(group_sizes) are not computed and come out zero."""
    m = x_MD.shape[0]
    if m < BLOCK:  # tiny inputs: padded to one block
        x_MD = jnp.pad(x_MD, ((0, BLOCK - m), (0, 0)))
    return _looped(x_MD, w1_EDF, w3_EDF, w2_EFD, group_sizes_E)[:m]


@jax.custom_vjp
def _looped(x_MD: Array, w1_EDF: Array, w3_EDF: Array, w2_EFD: Array, group_sizes_E: Array
            ) -> Array:
    m = x_MD.shape[0]
    blocks = _Blocks(group_sizes_E, m)

    def block(i: Array, y_MD: Array) -> Array:
        e, window = blocks.group[i], _Window.of(blocks, i, m)
        x_RD = window.rows(x_MD)
        h_RF = jax.nn.silu(x_RD @ w1_EDF[e]) * (x_RD @ w3_EDF[e])
        return window.put(y_MD, h_RF @ w2_EFD[e])

    y = _varying_like(jnp.zeros_like(x_MD), x_MD, w1_EDF, w3_EDF, w2_EFD)
    return lax.fori_loop(0, blocks.count, block, y)


def _fwd(x_MD: Array, w1_EDF: Array, w3_EDF: Array, w2_EFD: Array, group_sizes_E: Array
         ) -> tuple[Array, tuple[Array, ...]]:
    return (_looped(x_MD, w1_EDF, w3_EDF, w2_EFD, group_sizes_E),
            (x_MD, w1_EDF, w3_EDF, w2_EFD, group_sizes_E))


def _bwd(saved: tuple[Array, ...], g_MD: Array) -> tuple[Array, ...]:
    x_MD, w1_EDF, w3_EDF, w2_EFD, group_sizes_E = saved
    m = x_MD.shape[0]
    blocks = _Blocks(group_sizes_E, m)
    f32 = jnp.float32

    def block(i: Array, carry: tuple[Array, ...]) -> tuple[Array, ...]:
        dx_MD, dw1, dw3, dw2 = carry
        e, window = blocks.group[i], _Window.of(blocks, i, m)
        x_RD = window.rows(x_MD)
        dy_RD = jnp.where(window.real_R1, window.rows(g_MD), 0)  # other groups' rows: no grad
        w1_DF, w3_DF, w2_FD = w1_EDF[e], w3_EDF[e], w2_EFD[e]
        a_RF, c_RF = x_RD @ w1_DF, x_RD @ w3_DF
        sig_RF = jax.nn.sigmoid(a_RF)
        silu_RF = a_RF * sig_RF
        dh_RF = dy_RD @ w2_FD.T
        da_RF = dh_RF * c_RF * sig_RF * (1 + a_RF * (1 - sig_RF))  # silu' = s (1 + a (1 - s))
        dc_RF = dh_RF * silu_RF
        dx_MD = window.put(dx_MD, da_RF @ w1_DF.T + dc_RF @ w3_DF.T)
        outer = lambda a, b: jnp.dot(a.T, b, preferred_element_type=f32)  # noqa: E731
        return (dx_MD, dw1.at[e].add(outer(x_RD, da_RF)), dw3.at[e].add(outer(x_RD, dc_RF)),
                dw2.at[e].add(outer(silu_RF * c_RF, dy_RD)))

    operands = (x_MD, g_MD, w1_EDF, w3_EDF, w2_EFD)
    zeros = lambda shape, dtype: _varying_like(jnp.zeros(shape, dtype), *operands)  # noqa: E731
    dx, dw1, dw3, dw2 = lax.fori_loop(
        0, blocks.count, block, (zeros(x_MD.shape, x_MD.dtype), zeros(w1_EDF.shape, f32),
                                 zeros(w3_EDF.shape, f32), zeros(w2_EFD.shape, f32)))
    return (dx, dw1.astype(w1_EDF.dtype), dw3.astype(w3_EDF.dtype), dw2.astype(w2_EFD.dtype),
            np.zeros(group_sizes_E.shape, jax.dtypes.float0))


_looped.defvjp(_fwd, _bwd)
