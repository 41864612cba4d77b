"""Expert parallelism: MoE picks travel to the rank holding their expert by a ragged all-to-all
over the `ep` mesh axis, and the results come back the same way (TorchTitan's dispatch and
combine, MaxText's `ragged_all_to_all`).

Runs inside SimpleFSDP's shard_map (manual over the data axes, `ep` among them): each rank holds
`n_local = num_experts / ep` experts (expert e on rank e // n_local) and its own `m` picks.

The exchange. Every rank sorts its picks by expert (so by destination rank) and the ranks
all-gather their per-expert counts (ep x num_experts integers). From that one matrix
`exchange_plan` (a pure function) gives every offset and size of the two ragged exchanges:
each rank sends each destination exactly its picks for it, and the receiver packs what it got
source after source, real rows first. On TPU and GPU the exchange is `lax.ragged_all_to_all`
(only the picks travel); XLA:CPU has none, so there `dense_ragged_all_to_all` emulates it with
the same arguments by a dense all-to-all of slots sized for a whole rank's picks.

The buffers. The receive buffer is worst-case sized, `ep * m` rows (every pick of every rank
to one rank: dropless), as MaxText's is: memory, not traffic. Its padding rows carry the id
`n_local` (no expert): left out of the group sizes, not computed, zero out. The expert FFN
runs on the first `capacity` rows (`CAPACITY_FACTOR` times the balanced share) when they hold
every real row, as balanced-ish routing gives, and on the whole buffer otherwise
(`bounded_ffn`; only the taken branch runs). Dropless either way. The whole buffer goes
through in chunks of a rank's picks, each recomputed in backward, so that branch's working
set is one chunk's (the compiler sizes a conditional for its larger branch: over the whole
buffer at once it set the step's peak: 2.2 GB higher per chip at 30B-A3B v5p-16 ep8).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from titan_jax.models.sharding_hooks import ExpertFFN
from titan_jax.planner_hints import expected_branch

# Rows the expert FFN computes on its fast path, as a multiple of this rank's own picks.
CAPACITY_FACTOR = 1.25
ROW_ALIGN = 64  # the capacity is rounded up to this (the CPU grouped matmul's block)

# lax.ragged_all_to_all's signature: (operand, output, input_offsets, send_sizes,
# output_offsets, recv_sizes) -> output with the received slices written.
RaggedExchange = Callable[..., jax.Array]


class ExchangeSlices(NamedTuple):
    """One ragged all-to-all's arguments past the buffers, one entry per peer rank (see
    `lax.ragged_all_to_all`)."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def exchange_plan(counts_SD: jax.Array, rank: jax.Array) -> tuple[ExchangeSlices,
                                                                   ExchangeSlices]:
    """(dispatch, combine) slices of rank `rank`, from `counts_SD[s, d]`, the picks rank s
    sends rank d (every rank's, all-gathered). Dispatch: my rows sorted by destination, sent
    from offset sum_{d' < d} counts[me, d'], written on rank d after the rows of the ranks
    before me, sum_{s < me} counts[s, d]. Combine is its mirror: the results go back from
    where the rows arrived to where they left."""
    send_sizes, recv_sizes = counts_SD[rank], counts_SD[:, rank]
    sent_from = _exclusive_cumsum(counts_SD, axis=1)  # [s, d]: where s's rows for d start
    lands_at = _exclusive_cumsum(counts_SD, axis=0)  # [s, d]: where they go on d
    dispatch = ExchangeSlices(sent_from[rank], send_sizes, lands_at[rank], recv_sizes)
    combine = ExchangeSlices(lands_at[:, rank], recv_sizes, sent_from[:, rank], send_sizes)
    return dispatch, combine


def dense_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                            send_sizes: jax.Array, output_offsets: jax.Array,
                            recv_sizes: jax.Array, *, axis_name: str, slice_rows: int
                            ) -> jax.Array:
    """`lax.ragged_all_to_all` (one slice per peer) by a dense all-to-all, for XLA:CPU, which
    has no ragged one: every slice travels in a slot of `slice_rows` rows (its static bound)."""
    j = jnp.arange(slice_rows)
    src = jnp.where(j < send_sizes[:, None], input_offsets[:, None] + j, operand.shape[0])
    slots = operand.at[src].get(mode="fill", fill_value=0)  # (peers, slice_rows, ...)
    received = lax.all_to_all(slots, axis_name, 0, 0)  # [s] = the slot rank s sent here
    offsets_here = lax.all_to_all(output_offsets[:, None], axis_name, 0, 0)[:, 0]
    dest = jnp.where(j < recv_sizes[:, None], offsets_here[:, None] + j, output.shape[0])
    return output.at[dest].set(received, unique_indices=True, mode="drop")


def exchange_for(platform: str, picks: int) -> RaggedExchange:
    """The ragged all-to-all on the target devices' platform (see the module docstring);
    `picks` bounds one slice on CPU (a rank never sends or returns more than its picks)."""
    if platform == "cpu":
        return functools.partial(dense_ragged_all_to_all, slice_rows=picks)
    return lax.ragged_all_to_all


def expert_capacity(picks: int, rows: int) -> int:
    """Rows of the expert FFN's fast path (see the module docstring)."""
    capacity = -(-int(picks * CAPACITY_FACTOR) // ROW_ALIGN) * ROW_ALIGN
    return min(capacity, rows)


def bounded_ffn(ffn: ExpertFFN, rows_RD: jax.Array, ids_R: jax.Array, n_real: jax.Array,
                capacity: int, chunk: int) -> jax.Array:
    """`ffn` over the received rows (real rows first, `n_real` of them): over the first
    `capacity` rows when they hold every real row, else over all of them (`lax.cond`), in
    chunks of `chunk` rows (which divides the buffer)."""
    if capacity >= rows_RD.shape[0]:
        return ffn(rows_RD, ids_R)
    # Each branch as a function of its closed-over values (the experts' weights), for the VJP.
    fast, fast_weights = jax.closure_convert(ffn, rows_RD[:capacity], ids_R[:capacity])
    full, full_weights = jax.closure_convert(ffn, rows_RD[:chunk], ids_R[:chunk])
    branches = _Branches(fast, full, capacity, chunk, len(fast_weights))
    return _taken_branch(branches, rows_RD, ids_R, n_real, *fast_weights, *full_weights)


@dataclasses.dataclass(frozen=True)
class _Branches:
    """The two branches of `bounded_ffn`: `fast_ffn` on the first `capacity` rows, `full_ffn`
    on each `chunk` rows (each `(rows, ids, *weights) -> rows`); `weights` holds the fast
    branch's `n_fast` weights, then the full one's."""

    fast_ffn: Callable[..., jax.Array]
    full_ffn: Callable[..., jax.Array]
    capacity: int
    chunk: int
    n_fast: int

    def fast(self, rows: jax.Array, ids: jax.Array, *weights: jax.Array) -> jax.Array:
        y = self.fast_ffn(rows[:self.capacity], ids[:self.capacity], *weights[:self.n_fast])
        return jnp.pad(y, ((0, rows.shape[0] - self.capacity), (0, 0)))

    def full(self, rows: jax.Array, ids: jax.Array, *weights: jax.Array) -> jax.Array:
        """Chunk after chunk (the FFN sorts each chunk's rows by expert itself), each
        recomputed in backward: only the chunks' inputs are saved."""
        weights = weights[self.n_fast:]

        @jax.checkpoint
        def one(_: None, chunk: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
            return None, self.full_ffn(*chunk, *weights)

        n = rows.shape[0] // self.chunk
        _, y = lax.scan(one, None, (rows.reshape(n, self.chunk, *rows.shape[1:]),
                                    ids.reshape(n, self.chunk)))
        return y.reshape(rows.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _taken_branch(b: _Branches, rows: jax.Array, ids: jax.Array, n_real: jax.Array,
                  *weights: jax.Array) -> jax.Array:
    """The branch `n_real` takes. A custom VJP that saves only its inputs and recomputes the
    taken branch in backward: differentiated as is, a conditional saves the union of both
    branches' residuals (measured on CPU: +0.33 GB a device at the debug MoE recipe, ep 4)."""
    return lax.cond(n_real <= b.capacity, expected_branch(b.fast), b.full, rows, ids, *weights)


def _taken_branch_fwd(b: _Branches, rows: jax.Array, ids: jax.Array, n_real: jax.Array,
                      *weights: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    return _taken_branch(b, rows, ids, n_real, *weights), (rows, ids, n_real, *weights)


def _taken_branch_bwd(b: _Branches, saved: tuple[jax.Array, ...], g: jax.Array
                      ) -> tuple[Any, ...]:
    rows, ids, n_real, *weights = saved

    def grads(branch: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
        def run(rows: jax.Array, weights: list[jax.Array], g: jax.Array
                ) -> tuple[jax.Array, ...]:
            return jax.vjp(lambda x, w: branch(x, ids, *w), rows, weights)[1](g)
        return run

    d_rows, d_weights = lax.cond(n_real <= b.capacity, expected_branch(grads(b.fast)),
                                 grads(b.full), rows, weights, g)
    return (d_rows, None, None, *d_weights)


_taken_branch.defvjp(_taken_branch_fwd, _taken_branch_bwd)


def received_expert_ids(counts_SL: jax.Array, rows: int) -> jax.Array:
    """The local expert of each received row, (rows,): source after source, each source's rows
    sorted by expert (`counts_SL[s, e]` of them for local expert e); padding rows `n_local`."""
    n_local = counts_SL.shape[1]
    # Each row's (source, expert) group by counting the group ends at or before it: a cumsum
    # (jnp.repeat's way) over the rows would be a reduce-window as long as the buffer.
    ends = jnp.cumsum(counts_SL.reshape(-1))
    row = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.sum(ends[None, :] <= row[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(row < ends[-1], group % n_local, n_local)


def zeros_varying_like(x: jax.Array, rows: int) -> jax.Array:
    """A zero buffer of `rows` rows like `x`'s, typed as varying over the mesh axes `x` varies
    over. `lax.ragged_all_to_all` types its result as its output buffer: from a plain
    (invariant) zeros the exchanged rows would be typed as replicated, and autodiff would
    psum their cotangents over the data axes where they meet varying values."""
    buffer = jnp.zeros((rows, *x.shape[1:]), x.dtype)
    missing = tuple(a for a in jax.typeof(x).mat.varying
                    if a not in jax.typeof(buffer).mat.varying)
    return lax.pcast(buffer, missing, to="varying") if missing else buffer


def ragged_dispatch(rows_MD: jax.Array, experts_M: jax.Array, n_local: int, ffn: ExpertFFN,
                    axis: str, ep: int, exchange: RaggedExchange) -> jax.Array:
    """Each row (one pick) through its expert, held by rank `experts_M // n_local` of mesh
    axis `axis` (size `ep`); the results in the rows' order (see the module docstring)."""
    m = rows_MD.shape[0]
    order = jnp.argsort(experts_M, stable=True)  # by expert, so by destination rank
    counts_SE = lax.all_gather(jnp.bincount(experts_M, length=ep * n_local).astype(jnp.int32),
                               axis)
    rank = lax.axis_index(axis)
    dispatch, combine = exchange_plan(counts_SE.reshape(ep, ep, n_local).sum(-1), rank)
    send = functools.partial(exchange, axis_name=axis)
    rows = send(rows_MD[order], zeros_varying_like(rows_MD, ep * m), *dispatch)
    counts_SL = lax.dynamic_slice_in_dim(counts_SE, rank * n_local, n_local, axis=1)
    ids = received_expert_ids(counts_SL, ep * m)
    y = bounded_ffn(ffn, rows, ids, jnp.sum(dispatch.recv_sizes), expert_capacity(m, ep * m),
                    chunk=m)
    back = send(y, zeros_varying_like(y, m), *combine)
    return back[jnp.argsort(order)]
