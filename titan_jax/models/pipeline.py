"""The stacked layers run as a pipeline over stages: one `lax.scan` over clock ticks, every stage
vmapped over a stage dim that the mesh splits over `pp`, activations handed to the next stage
by a roll along that dim (a collective-permute once partitioned).

Placement. The layers (L) form `degree * virtual` chunks of consecutive layers; chunk c sits on
stage c mod degree (`virtual` 1: GPipe's contiguous stages; more: the circular, or interleaved,
placement of Megatron's interleaved 1F1B and MaxText's circular pipeline). Layer l of the stacked
arrays is (repeat r, stage s, layer j of the chunk) with l = (r * degree + s) * per_chunk + j.

Schedule. The batch is cut into `microbatches` (m) slices. Item k = r * m + i (microbatch i on
its r-th pass around the stages) enters stage 0 at tick k and stage s at tick k + s; ticks run
0 .. virtual * m + degree - 2, so a stage idles degree - 1 of them: the bubble,
(degree - 1) / (virtual * m + degree - 1). The last stage writes item k's output into a buffer
of m microbatches at slot i, from which stage 0 reads its next input: the batch's own slices
before their first pass, the last stage's outputs after it (that needs m >= degree, so a slot
is written before it is read again). Idle ticks run a stage on zeros or on a stale input and
their outputs and statistics are dropped, so their gradient is zero.

Backward is JAX's transpose of the tick scan: all forward ticks, then all backward ticks in
reverse (GPipe's order for both placements). Each stage keeps what the layer scan's remat
policy saves for each of its ticks (m microbatches' worth in flight, not 1F1B's degree).

Manual stages (`PipelineSplit.manual`, GPipe's placement): where the pipeline runs inside a
shard_map that holds `pp` manual (SimpleFSDP's shard_map implementation, so that Pallas
kernels in a stage see every mesh axis manual), each device runs its own stage on the layers
it stores, hands its output to the next stage with a `ppermute`, and keeps its own buffer: the
first stage's holds the batch's microbatches, the last stage's their outputs, which a sum over
`pp` (the other stages' masked to zero) gives every stage for the final norm and the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.models.sharding_hooks import PipelineSplit, constrain

Array = jax.Array
# (x (b, T, D), one chunk's layers (leaves (per_chunk, ...)), tables) -> (y, stats (per_chunk, ...))
ChunkScan = Callable[[Array, Any, tuple], tuple[Array, dict[str, Array]]]
# The stage dim of the pipeline's arrays is a group of layers: the table splits it like them.
STAGE_AXES = ("layers", "batch", "seq", "embed")


def bubble_fraction(degree: int, virtual: int, microbatches: int) -> float:
    """The share of a stage's ticks spent idle: (degree - 1) / (virtual * m + degree - 1)."""
    return (degree - 1) / (virtual * microbatches + degree - 1)


def pipeline_scan(
    chunk_scan: ChunkScan,
    x_BTD: Array,
    layers: Any,
    tables: tuple[Array | None, ...],
    split: PipelineSplit,
) -> tuple[Array, dict[str, Array]]:
    """`chunk_scan` over every layer, as `split`'s pipeline: (final activations (B, T, D), every
    layer's statistics (L, ...), summed over microbatches). `layers`: leaves stacked (L, ...)
    (None leaves allowed); `tables`: (cos, sin, segment ids), per position (T, H) or per token
    (B, T, ...), the latter cut into microbatches with the batch."""
    p, v, m = split.degree, split.virtual, split.microbatches
    b = x_BTD.shape[0]
    if b % m:
        raise ValueError(f"a batch of {b} rows does not split into {m} pipeline microbatches")
    if split.manual:
        return _manual_pipeline_scan(chunk_scan, x_BTD, layers, tables, split)
    items, ticks = v * m, v * m + p - 1

    def by_chunk(leaf: Array) -> Array:  # (L, ...) -> (v, p, L / (v p), ...)
        return leaf.reshape(v, p, leaf.shape[0] // (v * p), *leaf.shape[1:])

    chunks = jax.tree.map(by_chunk, layers)
    buffer_MbTD, tables_of = _microbatches(x_BTD, tables, m)
    stage = jnp.arange(p)

    def run_stage(x_bTD: Array, chunk: Any, r: Array | int, i: Array | int) -> tuple[Array, dict]:
        """One stage's tick: its chunk of repeat `r` over microbatch `i`'s activations."""
        layers_r = jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, r, 0, False), chunk)
        return chunk_scan(x_bTD, layers_r, tables_of(i))

    stages = jax.vmap(run_stage, in_axes=(0, 1, 0, 0), spmd_axis_name=split.axis)

    def tick(
        carry: tuple[Array, Array, dict[str, Array]], t: Array
    ) -> tuple[tuple[Array, Array, dict[str, Array]], None]:
        state_PbTD, buffer_MbTD, stats = carry
        k = t - stage  # the item each stage holds this tick
        valid = (k >= 0) & (k < items)
        k = jnp.clip(k, 0, items - 1)
        r, i = k // m, k % m
        y_PbTD, tick_stats = stages(state_PbTD, chunks, r, i)
        y_PbTD = constrain(y_PbTD, STAGE_AXES)
        stats = jax.tree.map(
            lambda acc, s: jax.vmap(_add_at)(acc, r, jnp.where(lead_mask(valid, s), s, 0)),
            stats,
            tick_stats,
        )
        # The last stage's output back into its microbatch's slot (idle ticks leave it).
        slot = i[p - 1]
        kept = jnp.where(valid[p - 1], y_PbTD[p - 1], buffer_MbTD[slot])
        buffer_MbTD = jax.lax.dynamic_update_index_in_dim(buffer_MbTD, kept, slot, 0)
        # Each stage's output to the next; stage 0 takes the next item from the buffer.
        rolled = jnp.roll(y_PbTD, 1, axis=0)
        fresh = jax.lax.dynamic_index_in_dim(buffer_MbTD, (t + 1) % m, 0, keepdims=False)
        state_PbTD = constrain(jnp.where(lead_mask(stage == 0, rolled), fresh, rolled), STAGE_AXES)
        return (state_PbTD, buffer_MbTD, stats), None

    state_PbTD = jnp.zeros((p, *buffer_MbTD.shape[1:]), x_BTD.dtype).at[0].set(buffer_MbTD[0])
    state_PbTD = constrain(state_PbTD, STAGE_AXES)
    # The statistics' shapes: one stage's tick, traced abstractly.
    one = jax.eval_shape(
        lambda: run_stage(buffer_MbTD[0], jax.tree.map(lambda c: c[:, 0], chunks), 0, 0)[1]
    )
    operands = (x_BTD, *jax.tree.leaves(chunks))
    zeros = jax.tree.map(
        lambda s: varying_like(jnp.zeros((p, v, *s.shape), s.dtype), operands), one
    )
    (_, buffer_MbTD, stats), _ = jax.lax.scan(
        tick, (state_PbTD, buffer_MbTD, zeros), jnp.arange(ticks)
    )
    # (stage, repeat, layer of chunk) -> the stacked layer order (repeat, stage, layer of chunk).
    stats = jax.tree.map(lambda s: s.swapaxes(0, 1).reshape(-1, *s.shape[3:]), stats)
    return buffer_MbTD.reshape(x_BTD.shape), stats


def _manual_pipeline_scan(
    chunk_scan: ChunkScan,
    x_BTD: Array,
    layers: Any,
    tables: tuple[Array | None, ...],
    split: PipelineSplit,
) -> tuple[Array, dict[str, Array]]:
    """`pipeline_scan` with `split.axis` manual: this device's stage, GPipe's placement. Its
    layers are the stacked inputs that vary over the axis (the weights, stored split over it);
    the others (the expert bias, dropout keys: whole on every stage) are cut to its block."""
    if split.virtual != 1:
        raise ValueError("manual pipeline stages take GPipe's placement (one chunk a stage)")
    axis, p, m = split.axis, split.degree, split.microbatches
    assert axis is not None
    stage = jax.lax.axis_index(axis)
    stored = [leaf for leaf in jax.tree.leaves(layers) if axis in jax.typeof(leaf).mat.varying]
    if not stored:
        raise ValueError(f"no stacked layer input is split over {axis!r}")
    per_stage = stored[0].shape[0]

    def own_block(leaf: Array) -> Array:
        if axis in jax.typeof(leaf).mat.varying:
            return leaf
        return jax.lax.dynamic_slice_in_dim(leaf, stage * per_stage, per_stage, 0)

    chunk = jax.tree.map(own_block, layers)
    inputs_MbTD, tables_of = _microbatches(x_BTD, tables, m)
    forward = [(s, s + 1) for s in range(p - 1)]

    def tick(
        carry: tuple[Array, Array, dict[str, Array]], t: Array
    ) -> tuple[tuple[Array, Array, dict[str, Array]], None]:
        state_bTD, outputs_MbTD, stats = carry
        k = t - stage  # the microbatch this stage holds this tick
        valid = (k >= 0) & (k < m)
        i = jnp.clip(k, 0, m - 1)
        y_bTD, tick_stats = chunk_scan(state_bTD, chunk, tables_of(i))
        stats = jax.tree.map(lambda acc, s: acc + jnp.where(valid, s, 0), stats, tick_stats)
        kept = jnp.where(valid & (stage == p - 1), y_bTD, outputs_MbTD[i])
        outputs_MbTD = jax.lax.dynamic_update_index_in_dim(outputs_MbTD, kept, i, 0)
        sent = jax.lax.ppermute(y_bTD, axis, forward)  # stage 0 receives zeros
        fresh = jax.lax.dynamic_index_in_dim(inputs_MbTD, (t + 1) % m, 0, keepdims=False)
        state_bTD = jnp.where(stage == 0, fresh, sent)
        return (state_bTD, outputs_MbTD, stats), None

    operands = (x_BTD, *jax.tree.leaves(chunk))
    state_bTD = varying_like(jnp.where(stage == 0, inputs_MbTD[0], 0), operands)
    outputs_MbTD = varying_like(jnp.zeros_like(inputs_MbTD), operands)
    one = jax.eval_shape(lambda: chunk_scan(state_bTD, chunk, tables_of(0))[1])
    zeros = jax.tree.map(lambda s: varying_like(jnp.zeros(s.shape, s.dtype), operands), one)
    (_, outputs_MbTD, stats), _ = jax.lax.scan(
        tick, (state_bTD, outputs_MbTD, zeros), jnp.arange(m + p - 1)
    )
    # The last stage's outputs to every stage; each stage's layers' statistics in layer order.
    outputs_MbTD = jax.lax.psum(jnp.where(stage == p - 1, outputs_MbTD, 0), axis)
    stats = jax.tree.map(
        lambda s: jax.lax.all_gather(s, axis, axis=0, tiled=True, to="invarying"), stats
    )
    return outputs_MbTD.reshape(x_BTD.shape), stats


def _microbatches(
    x_BTD: Array, tables: tuple[Array | None, ...], m: int
) -> tuple[Array, Callable[[Array | int], tuple[Array | None, ...]]]:
    """`x_BTD` cut into `m` microbatches (m, B / m, T, D), and microbatch i's tables: per
    position (T, H) tables are every microbatch's, per token (B, T, ...) ones travel with it."""
    b = x_BTD.shape[0]

    def microbatched(x: Array) -> Array:
        return x.reshape(m, b // m, *x.shape[1:])

    cos = tables[0]
    if cos is None or cos.ndim != 3:
        return microbatched(x_BTD), lambda i: tables
    mb_tables = tuple(None if t is None else microbatched(t) for t in tables)
    return microbatched(x_BTD), lambda i: tuple(None if t is None else t[i] for t in mb_tables)


def varying_like(init: Array, operands: tuple[Array, ...]) -> Array:
    """`init` varying over every manual mesh axis an operand varies over: inside a shard_map a
    loop's carry keeps one type, and the ticks mix the tokens and weights into it."""
    varying = lambda a: jax.typeof(a).mat.varying  # noqa: E731
    axes = set().union(*map(varying, operands)) - varying(init)
    return jax.lax.pcast(init, tuple(sorted(axes)), to="varying") if axes else init


def lead_mask(mask: Array, like: Array) -> Array:
    """`mask` (leading dims of `like`) broadcastable against `like`."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))


def _add_at(acc_V: Array, r: Array, x: Array) -> Array:
    """`acc_V` with `x` added at row `r`."""
    return acc_V.at[r].add(x)
