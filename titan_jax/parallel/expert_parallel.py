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
of every rank to one rank), as MaxText's is. Every step receives into a buffer of `capacity`
rows instead (`CAPACITY_FACTOR` times the balanced share): the picks that fit there, each
receiver filled source after source (`capped_counts`: all of them under balanced-ish routing),
go through the FFN and back in a first exchange outside any conditional, so the compiler can
overlap its all-to-alls with the layer's other work. The rest, the overflow, travels in a
second exchange into the worst-case buffer, through the FFN in blocks of a rank's picks (each
recomputed in backward: that branch's working set is one block's), under a `lax.cond` that
runs only when some rank overflows; the all-gathered counts say so before anything is sent,
the same on every rank of the exchange (`dropless_exchange`). Padding rows carry the id
`n_local` (no expert): left out of the group sizes, not computed, zero out. Its first form
received every step into the worst-case buffer (filled, relaid out, sliced and padded in every
layer's forward, recompute and backward: a large share of 235B-A22B's v5p-256 step under the
planner's estimate); its second chose a capacity or a worst-case branch for the whole exchange
up front, which left the exchanges inside a conditional, where nothing outside it can run
under them (docs/MOE.md).

The chunks (`parallelism.expert_parallel_chunks`). A layer's exchanges wait on each other's
neighbours: the dispatch on the router, the experts on the dispatch, the combine on the
experts. Split into chunks, each exchanged on its own, one chunk's dispatch and another's
combine can run while a third's experts compute; an optimization barrier joins them so, as
XLA:TPU's scheduler does not on its own (`dropless_exchange`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from titan_jax.models.permutation import permute
from titan_jax.models.sharding_hooks import ExpertFFN
from titan_jax.planner_hints import rare_branch

# Rows each rank receives in the first exchange, as a multiple of its own picks.
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


def exchange_plan(
    counts_SD: jax.Array, rank: jax.Array, starts_SD: jax.Array | None = None
) -> tuple[ExchangeSlices, ExchangeSlices]:
    """(dispatch, combine) slices of rank `rank`, from `counts_SD[s, d]`, the picks rank s
    sends rank d (every rank's, all-gathered), each slice starting at `starts_SD[s, d]` among
    s's rows (default: packed, sum_{d' < d} counts[s, d']). The receiver packs what it gets
    source after source: rank s's rows land on d after those of the ranks before it,
    sum_{s' < s} counts[s', d]. Combine is the mirror: the results go back from where the rows
    arrived to where they left."""
    send_sizes, recv_sizes = counts_SD[rank], counts_SD[:, rank]
    if starts_SD is None:
        starts_SD = _exclusive_cumsum(counts_SD, axis=1)
    lands_at = _exclusive_cumsum(counts_SD, axis=0)  # [s, d]: where s's rows go on d
    dispatch = ExchangeSlices(starts_SD[rank], send_sizes, lands_at[rank], recv_sizes)
    combine = ExchangeSlices(lands_at[:, rank], recv_sizes, starts_SD[:, rank], send_sizes)
    return dispatch, combine


def dense_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
    slice_rows: int,
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
    """Rows of the first exchange's receive buffer (see the module docstring)."""
    capacity = -(-int(picks * CAPACITY_FACTOR) // ROW_ALIGN) * ROW_ALIGN
    return min(capacity, rows)


def overflow_rows(picks: int, ep: int, capacity: int) -> int:
    """Rows of the overflow's receive buffer: what no receiver's first `capacity` rows hold
    when every rank sends it all its `picks`, in whole blocks of `picks` rows."""
    return -(-(ep * picks - capacity) // picks) * picks


class Delivery(NamedTuple):
    """What a dispatch leaves on the experts' side: the received rows, their local expert ids
    and gate weights, and the slices that send the results back."""

    rows: jax.Array
    ids: jax.Array
    gates: jax.Array
    back: ExchangeSlices


@dataclasses.dataclass(frozen=True)
class _Route:
    """A rank's side of the exchanges: its `m` picks (sorted by expert) go out by `exchange`
    over `axis` (`ep` ranks, `n_local` experts each), through the experts, and back. Every
    rank's count per expert (all-gathered) fixes every offset."""

    axis: str
    ep: int
    n_local: int
    m: int
    exchange: RaggedExchange

    def dispatch(
        self,
        rows_MD: jax.Array,
        gates_M: jax.Array,
        sent_SE: jax.Array,
        starts_SD: jax.Array,
        buffer_rows: int,
    ) -> Delivery:
        """Send `sent_SE[s, e]` rows and their gate weights per source and expert (each
        source's slice for rank d starting at `starts_SD[s, d]` of its sorted rows) into a
        receive buffer of `buffer_rows` rows (real rows first, padding rows the id `n_local`
        and gate 0). The gates travel too (a number a row) so that the FFN's outputs are scaled
        where they are computed: backward then takes the gates' gradient there, and needs no
        recomputed combine to bring the outputs to the tokens (one exchange of rows less a
        layer under remat)."""
        rank = lax.axis_index(self.axis)
        out, back = exchange_plan(self.per_rank(sent_SE), rank, starts_SD)
        send = functools.partial(self.exchange, axis_name=self.axis)
        received = send(rows_MD, zeros_varying_like(rows_MD, buffer_rows), *out)
        gates = send(gates_M, zeros_varying_like(gates_M, buffer_rows), *out)
        sent_SL = lax.dynamic_slice_in_dim(sent_SE, rank * self.n_local, self.n_local, axis=1)
        return Delivery(received, received_expert_ids(sent_SL, buffer_rows), gates, back)

    def combine(self, y: jax.Array, output_MD: jax.Array, back: ExchangeSlices) -> jax.Array:
        """The FFN's results `y` (a delivery's rows) back into `output_MD` at the rows they
        left from."""
        return self.exchange(y, output_MD, *back, axis_name=self.axis)

    def through(
        self,
        ffn: ExpertFFN,
        rows_MD: jax.Array,
        gates_M: jax.Array,
        sent_SE: jax.Array,
        starts_SD: jax.Array,
        buffer_rows: int,
        output_MD: jax.Array,
    ) -> jax.Array:
        """`dispatch`, `ffn` over what arrived, `combine`."""
        rows, ids, gates, back = self.dispatch(rows_MD, gates_M, sent_SE, starts_SD, buffer_rows)
        return self.combine(ffn(rows, ids, gates), output_MD, back)

    def per_rank(self, counts_SE: jax.Array) -> jax.Array:
        """(ep, ep) counts per (source, destination rank) from counts per (source, expert)."""
        return counts_SE.reshape(self.ep, self.ep, self.n_local).sum(-1)


def capped_counts(counts_SE: jax.Array, ep: int, capacity: int) -> jax.Array:
    """The picks per (source, expert) that fit in the receivers' first `capacity` rows, each
    receiver filled source after source, each source's rows for it in expert order (as they
    are sent): a prefix of every source's slice, and all of it where the receiver has room."""
    counts_SDL = counts_SE.reshape(ep, ep, -1)
    lands_at_SD = _exclusive_cumsum(counts_SDL.sum(-1), axis=0)
    sent_SD = jnp.clip(capacity - lands_at_SD, 0, counts_SDL.sum(-1))
    before_SDL = _exclusive_cumsum(counts_SDL, axis=2)
    return jnp.clip(sent_SD[..., None] - before_SDL, 0, counts_SDL).reshape(counts_SE.shape)


class _Chunk(NamedTuple):
    """One chunk of a rank's picks, sorted by expert (`order`, and its inverse permutation),
    with every rank's count per expert (`counts_SE`, all-gathered) and those its first
    exchange sends (`first_SE`)."""

    order: jax.Array
    inverse: jax.Array
    rows: jax.Array
    gates: jax.Array
    counts_SE: jax.Array
    first_SE: jax.Array


def dropless_exchange(
    ffn: ExpertFFN, chunks: list[_Chunk], route: _Route, capacity: int
) -> list[jax.Array]:
    """Every chunk's picks through `ffn` and back (each in its sorted order), dropless, with a
    receive buffer of `capacity` rows on the path every step runs: the picks that fit in it
    (all of them under balanced-ish routing) travel in a first exchange outside any
    conditional, so the compiler may overlap it with other work; those that do not, the
    overflow, travel in a second exchange through the worst-case buffer, under a conditional
    that runs it only when some rank overflows (the same decision on every rank: it is read
    off the all-gathered counts).

    The chunks' first exchanges are pipelined: an optimization barrier joins each chunk's FFN
    output with the next chunk's dispatch and the previous chunk's combine, so both of those
    exchanges run while this chunk's experts compute (XLA:TPU's scheduler, left alone, runs the
    chunks one after the other: docs/MOE.md)."""

    def starts(chunk: _Chunk) -> jax.Array:
        return _exclusive_cumsum(route.per_rank(chunk.counts_SE), axis=1)

    def dispatch(chunk: _Chunk) -> Delivery:
        return route.dispatch(chunk.rows, chunk.gates, chunk.first_SE, starts(chunk), capacity)

    delivered, outs = [dispatch(chunks[0])], []
    for i, chunk in enumerate(chunks):
        y = ffn(delivered[i].rows, delivered[i].ids, delivered[i].gates)
        if len(chunks) > 1:
            y, delivered[i + 1 :], outs[i - 1 :] = lax.optimization_barrier(
                (y, [dispatch(c) for c in chunks[i + 1 : i + 2]], outs[i - 1 :])
            )
        outs.append(route.combine(y, zeros_varying_like(chunk.rows, route.m), delivered[i].back))
    if capacity >= route.ep * route.m:
        return outs
    # The FFN over one block of `m` rows, as a function of its closed-over values (the experts'
    # weights, or their codes, scales and ports), for the overflow's VJP.
    block_ffn, weights = closure_convert(
        ffn,
        zeros_varying_like(chunks[0].rows, route.m),
        zeros_varying_like(chunks[0].rows, route.m, (route.m,), jnp.int32),
        zeros_varying_like(chunks[0].gates, route.m),
    )
    overflow = _Overflow(block_ffn, route, capacity)
    return [
        _with_overflow(overflow, y, c.rows, c.gates, c.counts_SE, c.first_SE, *weights)
        for y, c in zip(outs, chunks, strict=True)
    ]


def closure_convert(
    fun: Callable[..., jax.Array], *example_args: jax.Array
) -> tuple[Callable[..., jax.Array], list[jax.Array]]:
    """`jax.closure_convert`: `fun` on `example_args`' types as a function of them and of the
    traced values it closes over (returned), but hoisting every traced value. JAX's hoists
    only those with a tangent and leaves the others in the function (integers: experts
    gathered as int8 codes), which `_with_overflow` takes as a static argument: differentiated
    in a later trace (the layer's remat), they are stale tracers there, and the lowering fails
    ("No constant handler for type: DynamicJaxprTracer"; jax-ml/jax#14760)."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*example_args)
    traced = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    fixed = [None if t else c for c, t in zip(closed.consts, traced, strict=True)]
    hoisted = [c for c, t in zip(closed.consts, traced, strict=True) if t]
    jaxpr = closed.with_consts(())  # the consts as its first inputs: it holds no tracer
    out_tree = jax.tree.structure(out_shape)

    def converted(*args_and_hoisted: jax.Array) -> jax.Array:
        args, values = args_and_hoisted[: len(example_args)], args_and_hoisted[len(example_args) :]
        given = iter(values)
        consts = [next(given) if t else c for c, t in zip(fixed, traced, strict=True)]
        outs = jax.core.eval_jaxpr(jaxpr, (), *consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(out_tree, outs)

    return converted, hoisted


@dataclasses.dataclass(frozen=True)
class _Overflow:
    """A chunk's picks past the receivers' `capacity` rows: a second exchange into the
    worst-case buffer, the FFN over it block after block of `m` rows (`block_ffn(rows, ids,
    gates, *weights)`, which sorts each block's rows by expert itself), each block recomputed
    in backward so that only the blocks' inputs are saved. One conditional a chunk: one for
    all of a layer's chunks would hold all their worst-case buffers at once (235B-A22B
    v5p-256, 2 chunks: +7.7 GiB at the step's peak)."""

    block_ffn: Callable[..., jax.Array]
    route: _Route
    capacity: int

    def occurs(self, counts_SE: jax.Array) -> jax.Array:
        """Whether some rank receives more than `capacity` rows."""
        return jnp.max(self.route.per_rank(counts_SE).sum(0)) > self.capacity

    def add(
        self,
        y_MD: jax.Array,
        rows_MD: jax.Array,
        gates_M: jax.Array,
        counts_SE: jax.Array,
        first_SE: jax.Array,
        *weights: jax.Array,
    ) -> jax.Array:
        """`y_MD` with the overflowing picks' results written in."""
        route, m = self.route, self.route.m

        def blocked(x: jax.Array, ids: jax.Array, gates: jax.Array) -> jax.Array:
            @jax.checkpoint
            def one(_: None, block: tuple[jax.Array, ...]) -> tuple[None, jax.Array]:
                return None, self.block_ffn(*block, *weights)

            n = x.shape[0] // m
            _, y = lax.scan(
                one, None, (x.reshape(n, m, *x.shape[1:]), ids.reshape(n, m), gates.reshape(n, m))
            )
            return y.reshape(x.shape)

        starts_SD = _exclusive_cumsum(route.per_rank(counts_SE), axis=1) + route.per_rank(first_SE)
        return route.through(
            blocked,
            rows_MD,
            gates_M,
            counts_SE - first_SE,
            starts_SD,
            overflow_rows(m, route.ep, self.capacity),
            y_MD,
        )


# Hand-written VJP: it saves nothing of the overflow branch and recomputes it in backward when
# it ran, where autodiff's conditional keeps that branch's residuals every layer. Without it:
# tests/parallel/test_expert_parallel_aot.py::
# test_experts_run_the_megablox_kernels_counted_at_the_analytic_flops
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_overflow(
    o: _Overflow,
    y_MD: jax.Array,
    rows_MD: jax.Array,
    gates_M: jax.Array,
    counts_SE: jax.Array,
    first_SE: jax.Array,
    *weights: jax.Array,
) -> jax.Array:
    """`o.add` where some rank overflows, else `y_MD` as it is. Differentiated as is, the
    conditional would save the overflow branch's residuals (the worst-case buffer) every
    layer; this VJP saves nothing of its own and recomputes the overflow in backward when it
    occurred."""
    return lax.cond(
        o.occurs(counts_SE),
        rare_branch(o.add),
        lambda y, *_: y,
        y_MD,
        rows_MD,
        gates_M,
        counts_SE,
        first_SE,
        *weights,
    )


def _with_overflow_fwd(
    o: _Overflow, y_MD: jax.Array, *inputs: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    return _with_overflow(o, y_MD, *inputs), inputs


def _with_overflow_bwd(o: _Overflow, saved: tuple[jax.Array, ...], g: jax.Array) -> tuple[Any, ...]:
    rows_MD, gates_M, counts_SE, first_SE, *weights = saved
    # The weights with a tangent; the others (integer codes) get none and are read as they are.
    tangent = [jnp.issubdtype(w.dtype, jnp.inexact) for w in weights]

    def with_fixed(w: tuple[jax.Array, ...]) -> list[jax.Array]:
        given = iter(w)
        return [next(given) if t else fixed for fixed, t in zip(weights, tangent, strict=True)]

    def recomputed(g: jax.Array, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        _, pullback = jax.vjp(
            lambda x, gates, w: o.add(
                zeros_varying_like(g, g.shape[0]), x, gates, counts_SE, first_SE, *with_fixed(w)
            ),
            *inputs,
        )
        return pullback(g)

    def passed(g: jax.Array, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return jax.tree.map(lambda x: zeros_varying_like(x, x.shape[0]), inputs)

    differentiated = tuple(w for w, t in zip(weights, tangent, strict=True) if t)
    d_rows, d_gates, d_weights = lax.cond(
        o.occurs(counts_SE), rare_branch(recomputed), passed, g, (rows_MD, gates_M, differentiated)
    )
    d_given = iter(d_weights)
    # y_MD's cotangent is g as it is, outside the conditional, so that the first exchange's
    # backward need not wait for it: the rows the overflow writes are rows the first exchange
    # did not (its output buffer's zeros), whose cotangent it never reads.
    return (g, d_rows, d_gates, None, None, *(next(d_given) if t else None for t in tangent))


_with_overflow.defvjp(_with_overflow_fwd, _with_overflow_bwd)


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


def zeros_varying_like(
    x: jax.Array, rows: int, shape: tuple[int, ...] | None = None, dtype: Any = None
) -> jax.Array:
    """A zero buffer of `rows` rows like `x`'s (or of `shape` and `dtype`), typed as varying
    over the mesh axes `x` varies over. `lax.ragged_all_to_all` types its result as its output
    buffer: from a plain (invariant) zeros the exchanged rows would be typed as replicated,
    and autodiff would psum their cotangents over the data axes where they meet varying
    values."""
    buffer = jnp.zeros(
        (rows, *x.shape[1:]) if shape is None else shape, x.dtype if dtype is None else dtype
    )
    missing = tuple(a for a in jax.typeof(x).mat.varying if a not in jax.typeof(buffer).mat.varying)
    return lax.pcast(buffer, missing, to="varying") if missing else buffer


def ragged_dispatch(
    rows_MD: jax.Array,
    experts_M: jax.Array,
    gates_M: jax.Array,
    n_local: int,
    ffn: ExpertFFN,
    axis: str,
    ep: int,
    exchange: RaggedExchange,
    chunks: int = 1,
) -> jax.Array:
    """Each row (one pick) through its expert, held by rank `experts_M // n_local` of mesh
    axis `axis` (size `ep`), scaled by its gate weight; the results in the rows' order (see
    the module docstring). `chunks`: the rows travel in that many exchanges, pipelined, so
    that each one's exchanges run under another's experts."""
    m = rows_MD.shape[0] // chunks
    route = _Route(axis, ep, n_local, m, exchange)
    capacity = expert_capacity(m, ep * m)
    planned = []
    for c in range(chunks):
        rows, experts, gates = (a[c * m : (c + 1) * m] for a in (rows_MD, experts_M, gates_M))
        order = jnp.argsort(experts, stable=True)  # by expert, so by destination rank
        inverse = jnp.argsort(order)
        counts_SE = lax.all_gather(
            jnp.bincount(experts, length=ep * n_local).astype(jnp.int32), axis
        )
        planned.append(
            _Chunk(
                order,
                inverse,
                permute(rows, order, inverse),
                permute(gates, order, inverse),
                counts_SE,
                capped_counts(counts_SE, ep, capacity),
            )
        )
    backs = dropless_exchange(ffn, planned, route, capacity)
    return jnp.concatenate(
        [permute(y, c.inverse, c.order) for y, c in zip(backs, planned, strict=True)]
    )
