"""Expert parallelism: MoE picks travel to the rank holding their expert by an all-to-all over
the `ep` mesh axis, and the results come back by another (TorchTitan's dispatch and combine).

Runs inside SimpleFSDP's shard_map (manual over the data axes, `ep` among them): each rank holds
`n_local = num_experts / ep` experts (expert e on rank e // n_local) and its own tokens.

The exchange. JAX needs static shapes, so each rank sends every destination a buffer with room
for all of its picks (the worst case: every pick to one rank; dropless on every backend), by a
dense all-to-all, with the per-destination counts alongside. The receiver lays what it got out
as a ragged all-to-all would (`ragged_layout`): source s's picks at offset sum_{s' < s} of the
counts, so the real rows come first and the padding after them.

The experts' work. Padding rows carry the id `n_local` (no expert): left out of the group
sizes, not computed, zero out. The received rows are `ep` times a balanced share in the worst
case; the expert FFN runs on the first `capacity` rows (`CAPACITY_FACTOR` times the balanced
share) when they hold every real row, as balanced-ish routing gives, and on the whole buffer
otherwise (`bounded_ffn`; only the taken branch runs). Dropless either way; on CPU this keeps
expert parallelism's FLOPs near one device's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from titan_jax.models.sharding_hooks import ExpertFFN

# Rows the expert FFN computes on its fast path, as a multiple of this rank's own picks.
CAPACITY_FACTOR = 1.25
ROW_ALIGN = 64  # the capacity is rounded up to this (the CPU grouped matmul's block)


def ragged_layout(recv_sizes_S: jax.Array, slots: int) -> jax.Array:
    """Where row j of source s's buffer goes in the received rows, (S, slots): at source s's
    offset (the sizes of the sources before it) plus j; rows past a source's size (padding)
    point one past the end, so a scatter drops them and a gather reads zero."""
    offsets = jnp.cumsum(recv_sizes_S) - recv_sizes_S
    j = jnp.arange(slots)[None, :]
    return jnp.where(j < recv_sizes_S[:, None], offsets[:, None] + j,
                     recv_sizes_S.shape[0] * slots)


def expert_capacity(picks: int, rows: int) -> int:
    """Rows of the expert FFN's fast path (see the module docstring)."""
    capacity = -(-int(picks * CAPACITY_FACTOR) // ROW_ALIGN) * ROW_ALIGN
    return min(capacity, rows)


def bounded_ffn(ffn: ExpertFFN, rows_RD: jax.Array, ids_R: jax.Array, n_real: jax.Array,
                capacity: int) -> jax.Array:
    """`ffn` over the received rows (real rows first, `n_real` of them): over the first
    `capacity` rows when they hold every real row, else over all of them (`lax.cond`). The
    whole is recomputed in backward, so what is saved per layer is the input rows, not the
    activations of both branches (a conditional's residuals are the union of its branches')."""
    r = rows_RD.shape[0]
    if capacity >= r:
        return ffn(rows_RD, ids_R)

    def fast(rows: jax.Array, ids: jax.Array) -> jax.Array:
        return jnp.pad(ffn(rows[:capacity], ids[:capacity]), ((0, r - capacity), (0, 0)))

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def either(rows: jax.Array, ids: jax.Array, n: jax.Array) -> jax.Array:
        return lax.cond(n <= capacity, fast, ffn, rows, ids)

    return either(rows_RD, ids_R, n_real)


def all_to_all_dispatch(rows_MD: jax.Array, experts_M: jax.Array, n_local: int,
                        ffn: ExpertFFN, axis: str, ep: int) -> jax.Array:
    """Each row (one pick) through its expert, held by rank `experts_M // n_local` of mesh
    axis `axis` (size `ep`); the results in the rows' order (see the module docstring)."""
    m, d = rows_MD.shape
    dest = experts_M // n_local  # the rank that holds each pick's expert
    # Each pick's slot in its destination's buffer: picks to the same rank, in order.
    to_rank = dest[:, None] == jnp.arange(ep)[None, :]
    slot = jnp.take_along_axis(jnp.cumsum(to_rank, axis=0), dest[:, None], 1)[:, 0] - 1
    send_sizes = jnp.sum(to_rank, axis=0, dtype=jnp.int32)
    send = jnp.zeros((ep, m, d), rows_MD.dtype).at[dest, slot].set(rows_MD, unique_indices=True)
    send_ids = jnp.full((ep, m), n_local, jnp.int32).at[dest, slot].set(
        experts_M % n_local, unique_indices=True)
    # [s] = what rank s sent here, and how many of its rows are real.
    recv_sizes = lax.all_to_all(send_sizes[:, None], axis, 0, 0)[:, 0]
    where = ragged_layout(recv_sizes, m)
    rows = jnp.zeros((ep * m, d), rows_MD.dtype).at[where].set(
        lax.all_to_all(send, axis, 0, 0), unique_indices=True, mode="drop")
    ids = jnp.full((ep * m,), n_local, jnp.int32).at[where].set(
        lax.all_to_all(send_ids, axis, 0, 0), unique_indices=True, mode="drop")
    y = bounded_ffn(ffn, rows, ids, jnp.sum(recv_sizes), expert_capacity(m, ep * m))
    y = y.at[where].get(mode="fill", fill_value=0)  # back to each source's buffer
    returned = lax.all_to_all(y, axis, 0, 0)  # [r] = results of what was sent to rank r
    return returned[dest, slot]
