"""Expert parallelism: MoE picks travel to the rank holding their expert by an all-to-all over
the `ep` mesh axis, and the results come back by another (TorchTitan's dispatch and combine).

Runs inside SimpleFSDP's shard_map (manual over the data axes, `ep` among them): each rank holds
`n_local = num_experts / ep` experts (expert e on rank e // n_local) and its own tokens. JAX
needs static shapes, so each rank sends every destination a buffer with room for all of its
picks (the worst case: every pick to one rank): dropless on every backend, at `ep` times the
rows of a balanced exchange. Rows that carry no pick are computed and discarded. On TPU/GPU a
ragged all-to-all would send only the picks (XLA:CPU does not implement it); that is the next
step for large `ep`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from titan_jax.models.sharding_hooks import ExpertFFN


def all_to_all_dispatch(rows_MD: jax.Array, experts_M: jax.Array, n_local: int,
                        ffn: ExpertFFN, axis: str, ep: int) -> jax.Array:
    """Each row (one pick) through its expert, held by rank `experts_M // n_local` of mesh
    axis `axis` (size `ep`); the results in the rows' order (see the module docstring)."""
    m, d = rows_MD.shape
    dest = experts_M // n_local  # the rank that holds each pick's expert
    # Each pick's slot in its destination's buffer: picks to the same rank, in order.
    to_rank = dest[:, None] == jnp.arange(ep)[None, :]
    slot = jnp.take_along_axis(jnp.cumsum(to_rank, axis=0), dest[:, None], 1)[:, 0] - 1
    send = jnp.zeros((ep, m, d), rows_MD.dtype).at[dest, slot].set(rows_MD, unique_indices=True)
    send_ids = jnp.full((ep, m), -1, jnp.int32).at[dest, slot].set(
        experts_M % n_local, unique_indices=True)
    # [s] = what rank s sent here.
    received = lax.all_to_all(send, axis, 0, 0)
    received_ids = lax.all_to_all(send_ids, axis, 0, 0).reshape(-1)
    valid = received_ids >= 0
    y = ffn(received.reshape(ep * m, d), jnp.where(valid, received_ids, 0))
    y = jnp.where(valid[:, None], y, 0).reshape(ep, m, d)
    returned = lax.all_to_all(y, axis, 0, 0)  # [r] = results of what was sent to rank r
    return returned[dest, slot]
