"""`staged_psum_scatter` (titan_jax/parallel/reduce_scatter.py) on 8 simulated CPU devices: the
same rows on the same shards as one `psum_scatter`, over one axis of eight and over two axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec

from titan_jax.parallel.reduce_scatter import staged_psum_scatter


@pytest.mark.parametrize(
    "shape, axes", [((8,), ("a",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")), ((2, 4), ("b",))]
)
def test_staged_equals_one_psum_scatter(shape, axes):
    names = ("a", "b")[: len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    # each shard contributes its own rows: integers, so any summation order is exact
    x = jnp.arange(8 * 16 * 3, dtype=jnp.float32).reshape(8, 16, 3) % 7
    spec = PartitionSpec(names)

    def run(reduce):
        def body(x):
            return reduce(x[0] * (lax.axis_index(axes) + 1))[None]

        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        )(x)

    staged = run(lambda x: staged_psum_scatter(x, axes))
    single = run(lambda x: lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True))
    assert staged.shape == (8, 16 // np.prod([mesh.shape[a] for a in axes]), 3)
    np.testing.assert_array_equal(staged, single)
