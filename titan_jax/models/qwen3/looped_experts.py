"""The experts' SwiGLU on CPU: rows sorted by expert, one loop over blocks of `BLOCK` rows.

XLA:CPU runs `ragged_dot` like a masked dense matmul over every group
(docs/notes/2026-12-03-cpu-train-step.md), and a batched einsum over padded blocks needs every
block's copy of its expert's weights (blocks x D x F per projection, several times the weights
themselves; 0.79 GB of temporaries per layer at the debug MoE recipe's 8192 picks). Here a loop
over the experts slices each expert's weights once, and an inner loop visits only the blocks its
rows fill (`ceil(size / BLOCK)`; rows past the groups, an exchange buffer's padding, are never
visited and come out zero), running the whole SwiGLU of one block. Backward (a custom VJP that
saves only the inputs) loops the same way, recomputes the block's two input projections, and
sums the expert's weight gradients in the inner loop's carry: nothing per block outlives its
iteration, and no weight is copied per block (nor transposed: the contractions name the weights'
own dims)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
BLOCK = 64  # rows per block: of 16, 32, 64, 128 timed here at the debug shapes, 32 and 64 led


class _Groups(NamedTuple):
    """Where each group's rows start in the sorted rows, and how many there are."""

    start_E: Array
    size_E: Array

    @classmethod
    def of(cls, group_sizes_E: Array) -> _Groups:
        return cls(jnp.cumsum(group_sizes_E) - group_sizes_E, group_sizes_E)

    def blocks(self, e: Array) -> Array:
        return -(-self.size_E[e] // BLOCK)

    def window(self, e: Array, j: Array, m: int) -> _Window:
        """Group e's j-th block of rows in an array of `m` rows."""
        start = self.start_E[e] + j * BLOCK
        end = self.start_E[e] + self.size_E[e]
        first = jnp.minimum(start, m - BLOCK)
        row_R1 = first + jnp.arange(BLOCK)[:, None]
        return _Window(first, (row_R1 >= start) & (row_R1 < end))


def _varying_like(init: Array, *operands: Array) -> Array:
    """`init` varying over every manual mesh axis any operand varies over (inside shard_map a
    loop's carry must keep one type, and the loop body mixes the operands into it)."""
    varying = lambda a: jax.typeof(a).mat.varying  # noqa: E731
    axes = set().union(*map(varying, operands)) - varying(init)
    return lax.pcast(init, tuple(sorted(axes)), to="varying") if axes else init


class _Window(NamedTuple):
    """A block's rows: the `BLOCK` rows from `first` (kept inside the array, so a group's last
    block may start early), of which those marked real are the group's."""

    first: Array
    real_R1: Array

    def rows(self, x: Array) -> Array:
        return lax.dynamic_slice_in_dim(x, self.first, BLOCK)

    def put(self, x: Array, rows: Array) -> Array:
        """`rows` written in the window, only where they are the group's."""
        return lax.dynamic_update_slice_in_dim(
            x, jnp.where(self.real_R1, rows, self.rows(x)), self.first, 0
        )


def looped_swiglu(
    x_MD: Array, w1_EDF: Array, w3_EDF: Array, w2_EFD: Array, group_sizes_E: Array
) -> Array:
    """`w2_e(silu(w1_e x) * w3_e x)` for each row x of group e (rows sorted by group); rows
    past sum(group_sizes) are not computed and come out zero."""
    m = x_MD.shape[0]
    if m < BLOCK:  # tiny inputs: padded to one block
        x_MD = jnp.pad(x_MD, ((0, BLOCK - m), (0, 0)))
    return _looped(x_MD, w1_EDF, w3_EDF, w2_EFD, group_sizes_E)[:m]


# Hand-written VJP: reverse-mode autodiff is not defined for its loops' data-dependent
# bounds. Without it:
# tests/models/test_moe.py::
# test_looped_kernel_leaves_padding_rows_out_and_copies_no_weights_per_block
@jax.custom_vjp
def _looped(
    x_MD: Array, w1_EDF: Array, w3_EDF: Array, w2_EFD: Array, group_sizes_E: Array
) -> Array:
    m, groups = x_MD.shape[0], _Groups.of(group_sizes_E)

    def expert(e: Array, y_MD: Array) -> Array:
        w1_DF, w3_DF, w2_FD = w1_EDF[e], w3_EDF[e], w2_EFD[e]  # sliced once per expert

        def block(j: Array, y_MD: Array) -> Array:
            window = groups.window(e, j, m)
            x_RD = window.rows(x_MD)
            return window.put(y_MD, (jax.nn.silu(x_RD @ w1_DF) * (x_RD @ w3_DF)) @ w2_FD)

        return lax.fori_loop(0, groups.blocks(e), block, y_MD)

    y = _varying_like(jnp.zeros_like(x_MD), x_MD, w1_EDF, w3_EDF, w2_EFD)
    return lax.fori_loop(0, w1_EDF.shape[0], expert, y)


def _fwd(
    x_MD: Array, w1_EDF: Array, w3_EDF: Array, w2_EFD: Array, group_sizes_E: Array
) -> tuple[Array, tuple[Array, ...]]:
    return (
        _looped(x_MD, w1_EDF, w3_EDF, w2_EFD, group_sizes_E),
        (x_MD, w1_EDF, w3_EDF, w2_EFD, group_sizes_E),
    )


def _block_grads(
    x_RD: Array, dy_RD: Array, w1_DF: Array, w3_DF: Array, w2_FD: Array
) -> tuple[Array, ...]:
    """(dx, dw1, dw3, dw2) of one block (fp32 weight gradients); its input projections are
    recomputed. Contractions name the weights' own dims: no transposed weight copies."""
    f32 = jnp.float32
    a_RF, c_RF = x_RD @ w1_DF, x_RD @ w3_DF
    sig_RF = jax.nn.sigmoid(a_RF)
    silu_RF = a_RF * sig_RF
    dh_RF = jnp.einsum("rd,fd->rf", dy_RD, w2_FD)
    da_RF = dh_RF * c_RF * sig_RF * (1 + a_RF * (1 - sig_RF))  # silu' = s (1 + a (1 - s))
    dc_RF = dh_RF * silu_RF
    dx_RD = jnp.einsum("rf,df->rd", da_RF, w1_DF) + jnp.einsum("rf,df->rd", dc_RF, w3_DF)
    outer = lambda a, b: jnp.einsum("ri,rj->ij", a, b, preferred_element_type=f32)  # noqa: E731
    return dx_RD, outer(x_RD, da_RF), outer(x_RD, dc_RF), outer(silu_RF * c_RF, dy_RD)


def _bwd(saved: tuple[Array, ...], g_MD: Array) -> tuple[Array | np.ndarray, ...]:
    x_MD, w1_EDF, w3_EDF, w2_EFD, group_sizes_E = saved
    m, groups = x_MD.shape[0], _Groups.of(group_sizes_E)
    operands = (x_MD, g_MD, w1_EDF, w3_EDF, w2_EFD)
    zeros = lambda shape, dtype: _varying_like(jnp.zeros(shape, dtype), *operands)  # noqa: E731

    def expert(e: Array, carry: tuple[Array, ...]) -> tuple[Array, ...]:
        dx_MD, *dws = carry
        w1_DF, w3_DF, w2_FD = w1_EDF[e], w3_EDF[e], w2_EFD[e]

        def block(j: Array, inner: tuple[Array, ...]) -> tuple[Array, ...]:
            dx_MD, *sums = inner
            window = groups.window(e, j, m)
            dy_RD = jnp.where(window.real_R1, window.rows(g_MD), 0)  # other groups': no grad
            dx_RD, *grads = _block_grads(window.rows(x_MD), dy_RD, w1_DF, w3_DF, w2_FD)
            return (window.put(dx_MD, dx_RD), *(a + b for a, b in zip(sums, grads, strict=True)))

        sums = [zeros(w.shape, jnp.float32) for w in (w1_DF, w3_DF, w2_FD)]
        dx_MD, *sums = lax.fori_loop(0, groups.blocks(e), block, (dx_MD, *sums))
        return (dx_MD, *(dw.at[e].set(s.astype(dw.dtype)) for dw, s in zip(dws, sums, strict=True)))

    weights = (w1_EDF, w3_EDF, w2_EFD)
    dx, *dws = lax.fori_loop(
        0,
        w1_EDF.shape[0],
        expert,
        (zeros(x_MD.shape, x_MD.dtype), *(zeros(w.shape, w.dtype) for w in weights)),
    )
    return (dx, *dws, np.zeros(group_sizes_E.shape, jax.dtypes.float0))


_looped.defvjp(_fwd, _bwd)
