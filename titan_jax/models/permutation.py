"""Rows reordered by a permutation, whose gradient is the inverse reordering.

`x[order]` transposes, under autodiff, to a scatter-add of the cotangent into zeros: JAX does
not know `order` is a permutation. On TPU a scatter-add of a MoE layer's rows (each pick's
model-dim row) costs several times the gather that does the same job when every index is hit
once (as 235B-A22B's v5p-256 program showed). `permute`
says so: its backward is `g[inverse]`.
"""

from __future__ import annotations

import jax


# Hand-written VJP: the cotangent goes back by the inverse permutation's gather, where autodiff
# of indexing would scatter-add. Without it:
# tests/models/test_permutation.py::test_permute_equals_indexing_and_its_gradient_is_a_gather
@jax.custom_vjp
def permute(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """`x[order]` along the first axis, `inverse` being `order`'s inverse permutation
    (`argsort(order)`), which the backward gathers with."""
    return x[order]


def _permute_fwd(x: jax.Array, order: jax.Array, inverse: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x[order], inverse


def _permute_bwd(inverse: jax.Array, g: jax.Array) -> tuple[jax.Array, None, None]:
    return g[inverse], None, None


permute.defvjp(_permute_fwd, _permute_bwd)
