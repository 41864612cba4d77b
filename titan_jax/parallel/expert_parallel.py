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

The buffers. Dropless needs a receive buffer of `ep * m` rows in the worst case (every pick
of every rank to one rank), as MaxText's is. The all-gathered counts say before anything is
sent how many rows each rank will receive, the same on every rank of the exchange, so the
choice is made there (`bounded_exchange`, one `lax.cond` around dispatch, FFN and combine):
when no rank receives more than `capacity` rows (`CAPACITY_FACTOR` times the balanced share,
as balanced-ish routing gives) the exchange receives into a buffer of `capacity` rows and
the worst-case buffer never exists; otherwise into the worst-case one, through the FFN in
chunks of a rank's picks, each recomputed in backward, so that branch's working set is one
chunk's (the compiler sizes a conditional for its larger branch: over the whole buffer at once
it set the step's peak: 2.2 GB higher per chip at 30B-A3B v5p-16 ep8). Padding rows carry the
id `n_local` (no expert): left out of the group sizes, not computed, zero out. Deciding after
the exchange instead (its first form) filled, relaid out, sliced and padded the worst-case
buffer in every layer's forward, recompute and backward: ~1.2 s of 235B-A22B's v5p-256 step
under the planner's estimate.
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


@dataclasses.dataclass(frozen=True)
class _Route:
    """A rank's side of one exchange: its `m` picks (sorted by expert) go out by `exchange`
    over `axis` (`ep` ranks, `n_local` experts each), through the experts, and back. Every
    rank's count per expert (`counts_SE`, all-gathered) fixes every offset."""

    axis: str
    ep: int
    n_local: int
    m: int
    exchange: RaggedExchange

    def through(self, ffn: ExpertFFN, rows_MD: jax.Array, counts_SE: jax.Array,
                buffer_rows: int) -> jax.Array:
        """Dispatch into a receive buffer of `buffer_rows` rows (real rows first, padding rows
        the id `n_local`), `ffn` over it, and the results back in the sorted rows' order."""
        rank = lax.axis_index(self.axis)
        dispatch, combine = exchange_plan(
            counts_SE.reshape(self.ep, self.ep, self.n_local).sum(-1), rank)
        send = functools.partial(self.exchange, axis_name=self.axis)
        received = send(rows_MD, zeros_varying_like(rows_MD, buffer_rows), *dispatch)
        counts_SL = lax.dynamic_slice_in_dim(counts_SE, rank * self.n_local, self.n_local,
                                             axis=1)
        y = ffn(received, received_expert_ids(counts_SL, buffer_rows))
        return send(y, zeros_varying_like(y, self.m), *combine)


def bounded_exchange(ffn: ExpertFFN, rows_MD: jax.Array, counts_SE: jax.Array, route: _Route
                     ) -> jax.Array:
    """`route.through` with the smallest receive buffer every rank's rows fit: `capacity`
    rows when no rank receives more (as balanced-ish routing gives), else the worst-case
    buffer in chunks of `m` rows (`lax.cond`). The decision is read off the all-gathered
    counts, so every rank of the exchange takes the same branch (their collectives match),
    before anything is sent: the fast path never touches the worst-case buffer."""
    worst = route.ep * route.m
    capacity = expert_capacity(route.m, worst)
    if capacity >= worst:
        return route.through(ffn, rows_MD, counts_SE, worst)

    def traced(rows: int) -> tuple[Callable[..., jax.Array], list[jax.Array]]:
        """The FFN over `rows` rows as a function of its closed-over values (the experts'
        weights), for the VJP."""
        return jax.closure_convert(ffn, zeros_varying_like(rows_MD, rows),
                                   zeros_varying_like(rows_MD, rows, (rows,), jnp.int32))

    (fast, fast_weights), (full, full_weights) = traced(capacity), traced(route.m)
    branches = _Branches(fast, full, route, capacity, len(fast_weights))
    return _taken_branch(branches, rows_MD, counts_SE, *fast_weights, *full_weights)


@dataclasses.dataclass(frozen=True)
class _Branches:
    """The two branches of `bounded_exchange`, each `(rows, counts, *weights) -> rows`:
    `fast` through a receive buffer of `capacity` rows, `full` through the worst-case one
    chunk after chunk. `weights` holds the fast FFN's `n_fast` weights, then the full one's
    (each FFN is `(rows, ids, *weights) -> rows`, traced for its row count)."""

    fast_ffn: Callable[..., jax.Array]
    full_ffn: Callable[..., jax.Array]
    route: _Route
    capacity: int
    n_fast: int

    def fits(self, counts_SE: jax.Array) -> jax.Array:
        """Whether every rank receives at most `capacity` rows."""
        return jnp.max(jnp.sum(counts_SE, axis=0).reshape(self.route.ep, -1).sum(-1)
                       ) <= self.capacity

    def fast(self, rows: jax.Array, counts_SE: jax.Array, *weights: jax.Array) -> jax.Array:
        weights = weights[:self.n_fast]
        return self.route.through(lambda x, ids: self.fast_ffn(x, ids, *weights), rows,
                                  counts_SE, self.capacity)

    def full(self, rows: jax.Array, counts_SE: jax.Array, *weights: jax.Array) -> jax.Array:
        """The worst-case buffer chunk after chunk of `m` rows (the FFN sorts each chunk's
        rows by expert itself), each recomputed in backward: only the chunks' inputs are
        saved."""
        m, weights = self.route.m, weights[self.n_fast:]

        def chunked(x: jax.Array, ids: jax.Array) -> jax.Array:
            @jax.checkpoint
            def one(_: None, chunk: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
                return None, self.full_ffn(*chunk, *weights)

            n = x.shape[0] // m
            _, y = lax.scan(one, None, (x.reshape(n, m, *x.shape[1:]), ids.reshape(n, m)))
            return y.reshape(x.shape)

        return self.route.through(chunked, rows, counts_SE, self.route.ep * m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _taken_branch(b: _Branches, rows: jax.Array, counts_SE: jax.Array, *weights: jax.Array
                  ) -> jax.Array:
    """The branch the counts take. Differentiated as is, a conditional saves the union of both
    branches' residuals (measured on CPU: +0.33 GB a device at the debug MoE recipe, ep 4);
    this VJP saves the fast path's residuals (its pullback's: the received rows and what the
    FFN's own VJP keeps) beside the inputs, and recomputes only the fallback in backward. So
    the fast path's backward (the one balanced routing takes) does not exchange the rows again
    after full remat's recompute has just done so: one ragged all-to-all less a layer
    (docs/MOE.md)."""
    return lax.cond(b.fits(counts_SE), expected_branch(b.fast), b.full, rows, counts_SE,
                    *weights)


def _fast_residuals(b: _Branches, rows: jax.Array, counts_SE: jax.Array,
                    weights: tuple[jax.Array, ...]) -> tuple[jax.Array, Any, list, list]:
    """The fast path's output, its VJP's structure, for each of the VJP's leaves the input it
    is (an index into (rows, counts, *weights), or None) and the leaves that are not inputs:
    the residuals to keep (the inputs are kept anyway; through the conditional's output they
    would be copied, the experts' weights among them)."""
    y, pullback = jax.vjp(lambda x, w: b.fast(x, counts_SE, *w), rows, weights)
    leaves, tree = jax.tree.flatten(pullback)
    position = {id(x): i for i, x in enumerate((rows, counts_SE, *weights))}
    sources = [position.get(id(leaf)) for leaf in leaves]
    return y, tree, sources, [leaf for leaf, i in zip(leaves, sources, strict=True) if i is None]


def _taken_branch_fwd(b: _Branches, rows: jax.Array, counts_SE: jax.Array, *weights: jax.Array
                      ) -> tuple[jax.Array, tuple[Any, ...]]:
    # The fallback returns zeros in the fast residuals' places: one conditional, one type.
    avals = jax.make_jaxpr(lambda *a: _fast_residuals(b, a[0], a[1], a[2:])[3])(
        rows, counts_SE, *weights).out_avals

    def fast(rows: jax.Array, counts_SE: jax.Array, *weights: jax.Array
             ) -> tuple[jax.Array, list[jax.Array]]:
        y, _, _, residuals = _fast_residuals(b, rows, counts_SE, weights)
        return y, residuals

    def full(rows: jax.Array, counts_SE: jax.Array, *weights: jax.Array
             ) -> tuple[jax.Array, list[jax.Array]]:
        return b.full(rows, counts_SE, *weights), [_zeros_of(a) for a in avals]

    y, residuals = lax.cond(b.fits(counts_SE), expected_branch(fast), full, rows, counts_SE,
                            *weights)
    return y, (rows, counts_SE, weights, residuals)


def _zeros_of(aval: Any) -> jax.Array:
    """Zeros of `aval`'s shape and dtype, varying over the mesh axes it varies over."""
    zeros = jnp.zeros(aval.shape, aval.dtype)
    return lax.pcast(zeros, tuple(aval.mat.varying), to="varying") if aval.mat.varying else zeros


def _taken_branch_bwd(b: _Branches, saved: tuple[Any, ...], g: jax.Array) -> tuple[Any, ...]:
    rows, counts_SE, weights, residuals = saved
    structure: list[Any] = []  # (VJP structure, leaf sources), from a trace of the fast path

    def traced(*a: jax.Array) -> list[jax.Array]:
        _, tree, sources, kept = _fast_residuals(b, a[0], a[1], a[2:])
        structure[:] = [tree, sources]
        return kept

    jax.eval_shape(traced, rows, counts_SE, *weights)
    tree, sources = structure

    def fast(rows: jax.Array, weights: tuple[jax.Array, ...], residuals: list[jax.Array],
             g: jax.Array) -> tuple[Any, ...]:
        inputs, kept = (rows, counts_SE, *weights), iter(residuals)
        leaves = [next(kept) if i is None else inputs[i] for i in sources]
        return jax.tree.unflatten(tree, leaves)(g)

    def full(rows: jax.Array, weights: tuple[jax.Array, ...], residuals: list[jax.Array],
             g: jax.Array) -> tuple[Any, ...]:
        return jax.vjp(lambda x, w: b.full(x, counts_SE, *w), rows, weights)[1](g)

    d_rows, d_weights = lax.cond(b.fits(counts_SE), expected_branch(fast), full, rows, weights,
                                 residuals, g)
    return (d_rows, None, *d_weights)


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


def zeros_varying_like(x: jax.Array, rows: int, shape: tuple[int, ...] | None = None,
                       dtype: Any = None) -> jax.Array:
    """A zero buffer of `rows` rows like `x`'s (or of `shape` and `dtype`), typed as varying
    over the mesh axes `x` varies over. `lax.ragged_all_to_all` types its result as its output
    buffer: from a plain (invariant) zeros the exchanged rows would be typed as replicated,
    and autodiff would psum their cotangents over the data axes where they meet varying
    values."""
    buffer = jnp.zeros((rows, *x.shape[1:]) if shape is None else shape,
                       x.dtype if dtype is None else dtype)
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
    back = bounded_exchange(ffn, rows_MD[order], counts_SE, _Route(axis, ep, n_local, m,
                                                                    exchange))
    return back[jnp.argsort(order)]
