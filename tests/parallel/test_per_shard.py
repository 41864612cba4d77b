"""`manual_per_shard`: a kernel run on each device's shard inside SimpleFSDP's shard_map twin,
mapped over a model axis too, gives the plain kernel's output and gradients, and its backward
takes the kernel's residuals instead of computing the kernel's forward again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from titan_jax.parallel.per_shard import manual_per_shard


def tp_partial_sum(x, w):
    """One tp shard's slice of the hidden dim: its (1, rows, dim) partial sum of the output."""
    return (jnp.tanh(x @ w) @ w.T)[None]


def test_a_per_shard_kernel_over_a_model_axis_equals_the_plain_kernel_forward_once():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tp"))
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, (16, 6)), jax.random.normal(kw, (6, 4)) / 2

    def sharded(x, w):
        def local(x, w):
            w = lax.pcast(w, ("data",), to="varying")  # as a gathered weight is typed
            y = manual_per_shard(tp_partial_sum, (x, w), (P(), P(None, "tp")), P("tp"), ("data",))
            return lax.psum(jnp.sum(jnp.sum(y, axis=0) ** 2), "data")

        return jax.shard_map(
            local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), axis_names={"data"}
        )(x, w)

    def plain(x, w):
        return jnp.sum((jnp.tanh(x @ w) @ w.T) ** 2)

    grad = jax.value_and_grad(sharded, argnums=(0, 1))
    (got, got_grads), (want, want_grads) = (
        jax.jit(grad)(x, w),
        jax.value_and_grad(plain, argnums=(0, 1))(x, w),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, r in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    # The kernel's forward (its one tanh) runs once in the step: backward uses its residuals.
    assert str(jax.make_jaxpr(grad)(x, w)).count("tanh") == 1
