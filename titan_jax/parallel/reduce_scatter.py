"""A reduce-scatter over mesh axes that XLA:TPU compiles as one.

`lax.psum_scatter` over the eight chips of a v5p:2x2x2 (v5p-16), the sixteen of a v5p:2x2x4 or
a v6e:4x4, is lowered by XLA:TPU (libtpu 0.0.42.1) as an all-reduce with a full-size result
(followed by a dynamic-slice), at every size tried; over four chips, and the eight of a
v6e:2x4, it is one of its reduce-scatter emitters (the `all-reduce-scatter` fusions of the
compiled HLO, `SingleInputAllReduceScatterFusion` in their backend config). Measured in
tests/parallel/test_tpu_aot.py and docs/TPU.md. So `staged_psum_scatter` reduce-scatters one
mesh axis at a time, major axis first, and an axis of more than four shards in two steps:
over pairs of shards half the axis apart, then over each half; on every topology above each
step compiles to a reduce-scatter. Each step keeps a contiguous block of rows, so the result
is that of the single `psum_scatter(x, axes, scatter_dimension=0, tiled=True)`, with the same
ring bytes ((n - 1) / n of the input per shard).
"""

from __future__ import annotations

import jax
from jax import lax

# Largest axis reduce-scattered in one step (XLA:TPU keeps four chips a reduce-scatter on
# every torus it compiles for).
MAX_GROUP = 4


def staged_psum_scatter(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`psum_scatter(x, axes, scatter_dimension=0, tiled=True)` inside shard_map, manual
    over `axes`, one step per axis, two for an even axis of more than MAX_GROUP shards."""
    for axis in axes:
        size = lax.axis_size(axis)
        if size <= MAX_GROUP or size % 2:
            x = lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
            continue
        half = size // 2
        # Shard i = a * half + b: first keep half a of the rows (pairs {b, half + b}), then
        # the b-th block of that half (the shards of half a).
        x = lax.psum_scatter(
            x,
            axis,
            scatter_dimension=0,
            tiled=True,
            axis_index_groups=[[b, half + b] for b in range(half)],
        )
        x = lax.psum_scatter(
            x,
            axis,
            scatter_dimension=0,
            tiled=True,
            axis_index_groups=[list(range(half)), list(range(half, size))],
        )
    return x
