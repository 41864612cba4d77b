"""`permute`: rows reordered by a permutation, differentiated by the inverse reordering (a
gather) where `x[order]` would transpose to a scatter-add."""

import jax
import jax.numpy as jnp
import numpy as np

from titan_jax.models.permutation import permute


def test_permute_equals_indexing_and_its_gradient_is_a_gather():
    x = jax.random.normal(jax.random.key(0), (6, 3))
    order = jnp.asarray([4, 0, 5, 1, 3, 2])
    inverse = jnp.argsort(order)
    weight = jax.random.normal(jax.random.key(1), (6, 3))

    def loss(f, x):
        return jnp.sum(jnp.sin(f(x)) * weight)

    np.testing.assert_array_equal(permute(x, order, inverse), x[order])
    want = jax.grad(lambda x: loss(lambda v: v[order], x))(x)
    got = jax.grad(lambda x: loss(lambda v: permute(v, order, inverse), x))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    hlo = (
        jax.jit(jax.grad(lambda x: loss(lambda v: permute(v, order, inverse), x)))
        .lower(x)
        .as_text()
    )
    assert "scatter" not in hlo and "gather" in hlo
    plain = jax.jit(jax.grad(lambda x: loss(lambda v: v[order], x))).lower(x).as_text()
    assert "scatter" in plain  # what it replaces
