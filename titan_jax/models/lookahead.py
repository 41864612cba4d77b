"""The layer scan with look-ahead gathers: layer i+1's weights gathered while layer i computes.

Why: each layer's FSDP all-gathers can overlap only the compute the schedule places between
their start and their use. Gathered at their use inside the iteration (and, since
`compiler_workarounds.cast_in_loop`, after that iteration's cast), the 8B v5p-8 step's in-loop
gathers were 69% covered (docs/TPU.md). Carrying the next layer's gathered (compute-dtype)
weights in the scan gives each forward gather a whole layer's forward to hide under: MaxText's
weight prefetch across scanned layers (its PR #4493, forward only, as here).

Backward. The carried weights are never saved for backward: that would keep every layer's
gathered weights, the copy re-sharding after forward exists to avoid. Each layer is a
custom_vjp whose forward saves only its input and its stored weight shards (a slice of the
stacked weights: nothing new), and whose backward gathers the shards again, recomputes the
layer and sends the weights' cotangent through the gather's own backward (SimpleFSDP's fp32
reduce-scatter), inside the backward loop's iteration as without the look-ahead. That is full
activation checkpointing (`activation_checkpoint.mode = "full"` with re-sharding after
forward), the only mode this scan implements. For gradients the carry does not exist: the
weights layer i uses are, as far as derivatives go, gather(its shard).

Gathering ahead in backward too (each backward iteration gathering layer i-1's weights and
passing them back as the carry's cotangent) was built and measured on the debug model
(v5e-4): XLA:TPU made those loop-carried gathers synchronous, at the end of the iteration,
and the in-loop coverage fell to 42% (69% plain, 72% with the forward look-ahead;
docs/TPU.md), so the backward gathers stay where they were.

The last iteration's look-ahead gathers the first layer again, unused: one layer's gathers
more per forward, where skipping it would put a conditional around the collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

# (x, one layer's gathered weights, that layer's scanned inputs, loop constants) -> (y, out).
Block = Callable[[jax.Array, nnx.State, Any, Any], tuple[jax.Array, Any]]
# One layer's stored weights (a slice of the stacked state) -> the weights as the layer uses.
Gather = Callable[[nnx.State], nnx.State]


def scan_with_lookahead(
    block: Block, gather: Gather, x: jax.Array, stacked: nnx.State, xs: Any, consts: Any
) -> tuple[jax.Array, Any]:
    """`lax.scan` of `block` over the layers of `stacked` (and `xs`, per layer), each layer's
    weights gathered one iteration ahead; (final x, the stacked `out`s)."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    frozen = lax.stop_gradient(stacked)  # the look-ahead reads: outside differentiation

    def ahead(i: jax.Array) -> nnx.State:
        layer = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), frozen)
        return lax.stop_gradient(gather(layer))

    def body(
        carry: tuple[jax.Array, nnx.State], inputs: tuple[jax.Array, nnx.State, Any]
    ) -> tuple[tuple[jax.Array, nnx.State], Any]:
        x, gathered = carry
        i, layer, xs_i = inputs
        next_gathered = ahead((i + 1) % n)
        y, out = _layer(block, gather, x, gathered, layer, xs_i, consts)
        return (y, next_gathered), out

    (x, _), outs = lax.scan(body, (x, ahead(jnp.int32(0))), (jnp.arange(n), stacked, xs))
    return x, outs


# Hand-written VJP: backward gathers the layer's weights again, where autodiff would keep every
# layer's carried gathered weights for it. Without it:
# tests/parallel/test_tpu_aot.py::test_lookahead_gather_raises_the_compiled_gather_overlap
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layer(
    block: Block,
    gather: Gather,
    x: jax.Array,
    gathered: nnx.State,
    layer: nnx.State,
    xs_i: Any,
    consts: Any,
) -> tuple[jax.Array, Any]:
    """`block` on the carried `gathered` weights; differentiated as `block` on gather(`layer`)."""
    del gather, layer
    return block(x, gathered, xs_i, consts)


def _layer_fwd(
    block: Block,
    gather: Gather,
    x: jax.Array,
    gathered: nnx.State,
    layer: nnx.State,
    xs_i: Any,
    consts: Any,
) -> tuple[tuple[jax.Array, Any], Any]:
    return block(x, gathered, xs_i, consts), (x, layer, xs_i, consts)


def _layer_bwd(block: Block, gather: Gather, saved: Any, ct: Any) -> tuple[Any, ...]:
    x, layer, xs_i, consts = saved
    gathered, gather_vjp = jax.vjp(gather, layer)  # gathered again, not saved
    _, block_vjp = jax.vjp(block, x, gathered, xs_i, consts)  # the layer recomputed
    ct_x, ct_gathered, ct_xs, ct_consts = block_vjp(ct)
    (ct_layer,) = gather_vjp(ct_gathered)  # the gather's backward: the fp32 reduction
    return ct_x, None, ct_layer, ct_xs, ct_consts


_layer.defvjp(_layer_fwd, _layer_bwd)
