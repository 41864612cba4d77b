"""The layer scan with look-ahead gathers: each layer's weights gathered one layer ahead.

Why: each layer's FSDP all-gathers can overlap only the compute the schedule places between
their start and their use. Gathered at their use inside the iteration (and, since
`simple_fsdp.cast_in_loop`, after that iteration's cast), the 8B v5p-8 step's in-loop gathers
were 69% covered (docs/TPU.md). Carrying the next layer's gathered (compute-dtype) weights in
the scan gives each gather a whole layer's compute to hide under: MaxText's weight prefetch
across scanned layers (its PR #4493, forward only), here in backward too.

The whole scan is one custom_vjp. Forward: iteration i runs layer i on the carried weights
while it gathers layer i+1's; it saves each layer's input (what full activation checkpointing
saves), never a gathered weight (that would keep every layer's, the copy re-sharding after
forward exists to avoid). Backward: a reverse scan whose iteration i recomputes layer i from
its input on the carried weights while it gathers layer i-1's, and sends the weights'
cotangent through the gather's own backward (SimpleFSDP's fp32 reduce-scatter). That is
`activation_checkpoint.mode = "full"` with re-sharding after forward, the only mode this scan
implements, with each layer's gradient what the plain scan computes.

The forward's last iteration gathers the last layer again (for the backward's first), the
backward's last gathers the first again, unused: one layer's gathers more per step, where
skipping it would put a conditional around the collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from titan_jax.models.sharding_hooks import loop_context

# (x, one layer's gathered weights, that layer's scanned inputs, loop constants) -> (y, out).
Block = Callable[[jax.Array, nnx.State, Any, Any], tuple[jax.Array, Any]]
# One layer's stored weights (a slice of the stacked state) -> the weights as the layer uses.
Gather = Callable[[nnx.State], nnx.State]


def scan_with_lookahead(block: Block, gather: Gather, x: jax.Array, stacked: nnx.State,
                        xs: Any, consts: Any) -> tuple[jax.Array, Any]:
    """`lax.scan` of `block` over the layers of `stacked` (and `xs`, per layer), each layer's
    weights gathered one layer ahead; (final x, the stacked `out`s). `consts` (the same for
    every layer) are not differentiated."""
    return _scan(block, gather, x, stacked, xs, lax.stop_gradient(consts))


def _layer_at(stacked: nnx.State, i: jax.Array) -> nnx.State:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)


def _n_layers(stacked: nnx.State) -> int:
    return jax.tree.leaves(stacked)[0].shape[0]


def _forward(block: Block, gather: Gather, x: jax.Array, stacked: nnx.State, xs: Any,
             consts: Any) -> tuple[tuple[jax.Array, Any], tuple[jax.Array, nnx.State]]:
    """((final x, outs), (each layer's input, the last layer's gathered weights))."""
    n = _n_layers(stacked)

    def body(carry: tuple[jax.Array, nnx.State], inputs: tuple[jax.Array, Any]
             ) -> tuple[tuple[jax.Array, nnx.State], tuple[Any, jax.Array]]:
        x, gathered = carry
        i, xs_i = inputs
        ahead = gather(_layer_at(stacked, jnp.minimum(i + 1, n - 1)))
        y, out = block(x, gathered, xs_i, consts)
        return (y, ahead), (out, x)

    first = gather(_layer_at(stacked, jnp.int32(0)))
    (x, last), (outs, inputs) = lax.scan(body, (x, first), (jnp.arange(n), xs))
    return (x, outs), (inputs, last)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan(block: Block, gather: Gather, x: jax.Array, stacked: nnx.State, xs: Any,
          consts: Any) -> tuple[jax.Array, Any]:
    return _forward(block, gather, x, stacked, xs, consts)[0]


def _scan_fwd(block: Block, gather: Gather, x: jax.Array, stacked: nnx.State, xs: Any,
              consts: Any) -> tuple[tuple[jax.Array, Any], Any]:
    result, (inputs, last) = _forward(block, gather, x, stacked, xs, consts)
    return result, (inputs, last, stacked, xs, consts)


def _scan_bwd(block: Block, gather: Gather, saved: Any, ct: tuple[jax.Array, Any]
              ) -> tuple[Any, ...]:
    inputs, last, stacked, xs, consts = saved
    ct_x, ct_outs = ct

    def body(carry: tuple[jax.Array, nnx.State], step: tuple[jax.Array, ...]
             ) -> tuple[tuple[jax.Array, nnx.State], tuple[nnx.State, Any]]:
        ct_y, gathered = carry
        i, x_i, xs_i, ct_out = step
        ahead = gather(_layer_at(stacked, jnp.maximum(i - 1, 0)))
        _, block_vjp = jax.vjp(block, x_i, gathered, xs_i, consts)  # the layer recomputed
        ct_x, ct_gathered, ct_xs, _ = block_vjp((ct_y, ct_out))
        # The gather's backward (the fp32 reduction); its forward is dead code.
        (ct_layer,) = jax.vjp(gather, _layer_at(stacked, i))[1](ct_gathered)
        return (ct_x, ahead), (ct_layer, ct_xs)

    steps = (jnp.arange(_n_layers(stacked)), inputs, xs, ct_outs)
    with loop_context():  # traced outside the data-shard map's axes
        (ct_x, _), (ct_stacked, ct_xs) = lax.scan(body, (ct_x, last), steps, reverse=True)
    return ct_x, ct_stacked, ct_xs, None


_scan.defvjp(_scan_fwd, _scan_bwd)
