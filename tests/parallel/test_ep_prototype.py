"""EP readiness: a token all-to-all over the data axis composes with both SimpleFSDP paths.

A toy expert layer runs inside `SimpleFSDP.loss_map`: each data shard splits its tokens into
one group per shard, an all-to-all sends group e to shard e, shard e applies expert e's
(FSDP-gathered) weight, and a second all-to-all brings the results home. In the jit path the
all-to-all names the per-shard vmap axis (`SHARDS`), which GSPMD lowers to a real all-to-all
over the data-parallel mesh axes; in the shard_map twin it names the mesh axis. Both compile in
one step and differentiate to the dense reference. Only the shard_map twin is guaranteed to
emit an all-to-all: GSPMD lowers the vmapped one as it sees fit (all-gathers here), so models
with expert parallelism use the shard_map path (docs/ARCHITECTURE.md). Expert weights sharded
on their own `ep` axis, rather than gathered, come with the MoE layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from titan_jax.parallel.mesh import MeshDegrees, build_mesh
from titan_jax.parallel.rules import ShardingRules
from titan_jax.parallel.simple_fsdp import IMPLEMENTATIONS, SHARDS, SimpleFSDP
from titan_jax.planner import inspect_step

N_SHARDS, TOKENS, D = 8, 16, 8  # per shard: TOKENS tokens, one group of TOKENS/8 per expert
AXES = ("expert", "embed", "mlp")


def expert_layer(fsdp: SimpleFSDP, axis: str):
    def summed_loss(params, buffers, x_ND, labels):
        del buffers, labels
        w_EDF = fsdp.use_param(params["experts"], AXES, jnp.float32)
        grouped = x_ND.reshape(N_SHARDS, -1, D)  # group e goes to shard e
        received = lax.all_to_all(grouped, axis, 0, 0)  # [s] = shard s's group for me
        shard = lax.axis_index(axis)
        out = jnp.tanh(received @ w_EDF[shard])
        back = lax.all_to_all(out, axis, 0, 0).reshape(-1, D)
        return jnp.sum(back * back), {"loss": jnp.zeros(()), "stats": {}}

    return summed_loss


def reference(w_EDF, x_ND):
    per_shard = x_ND.reshape(N_SHARDS, N_SHARDS, -1, D)  # (source shard, expert, group, D)
    out = jnp.tanh(jnp.einsum("segd,edf->segf", per_shard, w_EDF))
    return jnp.sum(out * out)


@pytest.mark.parametrize("implementation", ["jit", "shard_map"])
def test_all_to_all_dispatch_composes_with_simple_fsdp(implementation):
    mesh = build_mesh(MeshDegrees(1, N_SHARDS, 1))
    rules = ShardingRules(mesh)
    specs = rules.storage_specs(
        {"experts": jax.ShapeDtypeStruct((N_SHARDS, D, D), jnp.float32)}, {"experts": AXES}
    )
    spec = specs["experts"]
    fsdp = IMPLEMENTATIONS[implementation](rules, specs)
    axis = SHARDS if implementation == "jit" else "fsdp"

    def loss(params, x):
        with fsdp.installed():
            return fsdp.loss_map(expert_layer(fsdp, axis))(params, {}, x, x)[0]

    w = jax.random.normal(jax.random.key(0), (N_SHARDS, D, D)) / np.sqrt(D)
    x = jax.random.normal(jax.random.key(1), (N_SHARDS * TOKENS, D))
    params = {"experts": jax.device_put(w, NamedSharding(mesh, spec))}
    x_sharded = jax.device_put(x, NamedSharding(mesh, P(rules.data_axes)))
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss))
        hlo = step.lower(params, x_sharded).compile().as_text()
        value, grads = step(params, x_sharded)
    want, want_grad = jax.value_and_grad(reference)(w, x)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(grads["experts"], want_grad, rtol=1e-4, atol=1e-5)
    collectives = {c["op"] for c in inspect_step.collective_counts(hlo)}
    if implementation == "shard_map":
        assert "all-to-all" in collectives, collectives
    else:
        # The partitioner lowers the vmapped all-to-all (a transpose of the sharded shard dim)
        # as it sees fit: here all-gathers, N times the bytes. Hence EP uses the shard_map path.
        assert "all-gather" in collectives, collectives
