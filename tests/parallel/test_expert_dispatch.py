"""The expert-parallel exchange (parallel/expert_parallel.py) against every expert run locally:
outputs and gradients, on the fast path (balanced routing: the real rows fit the capacity) and
the overflow path (every pick to one rank), and the ragged layout's offset arithmetic."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titan_jax.models.qwen3.moe import expert_ffn
from titan_jax.parallel import expert_parallel
from titan_jax.parallel.expert_parallel import all_to_all_dispatch, ragged_layout

EP, E, K, N, D, F = 4, 8, 2, 64, 16, 24  # per rank: N tokens; E // EP experts


def test_ragged_layout_puts_each_sources_rows_at_its_offset():
    where = np.asarray(ragged_layout(jnp.array([2, 0, 3]), 4))
    np.testing.assert_array_equal(where, [[0, 1, 12, 12], [12, 12, 12, 12], [2, 3, 4, 12]])


def local_dispatch(rows, experts, n_local, ffn):
    del n_local
    return ffn(rows, experts)


def moe_out(dispatch, x, experts, weights, w1, w3, w2, n_local):
    """sum_k weights * FFN_{expert}(x), each (token, slot) pick one row through `dispatch`."""
    def ffn(rows, ids):
        return expert_ffn(rows, ids, w1, w3, w2, "blocked")

    n, k = experts.shape
    y = dispatch(x[jnp.arange(n * k) // k], experts.reshape(-1), n_local, ffn)
    return jnp.einsum("nk,nkd->nd", weights, y.reshape(n, k, -1).astype(jnp.float32))


def loss_fns(mesh):
    def local(x, experts, weights, w1, w3, w2):
        return jnp.sum(jnp.sin(moe_out(local_dispatch, x, experts, weights, w1, w3, w2, E)))

    def per_rank(x, experts, weights, w1, w3, w2):
        dispatch = functools.partial(all_to_all_dispatch, axis="ep", ep=EP)
        out = moe_out(dispatch, x, experts, weights, w1, w3, w2, E // EP)
        return jax.lax.psum(jnp.sum(jnp.sin(out)), "ep")

    rows, experts_split = P("ep"), P("ep")
    sharded = jax.shard_map(per_rank, mesh=mesh, out_specs=P(), check_vma=False,
                            in_specs=(rows, rows, rows, experts_split, experts_split,
                                      experts_split))
    return local, sharded


@pytest.mark.parametrize("routing", ["balanced", "all_to_rank_0"])
def test_exchange_equals_local_experts_outputs_and_gradients(routing):
    mesh = jax.make_mesh((EP,), ("ep",), devices=jax.devices()[:EP],
                         axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(EP * N, D)), jnp.float32)
    if routing == "balanced":
        experts = np.stack([rng.permutation(E)[:K] for _ in range(EP * N)])
    else:  # experts 0 and 1 live on rank 0: it receives every pick, ep times its share
        experts = np.tile([0, 1], (EP * N, 1))
    experts = jnp.asarray(experts, jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(EP * N, K)), jnp.float32), -1)
    ws = [jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in
          ((E, D, F), (E, D, F), (E, F, D))]
    local, sharded = loss_fns(mesh)
    grad = functools.partial(jax.value_and_grad, argnums=(0, 2, 3, 4, 5))
    want, want_grads = jax.jit(grad(local))(x, experts, weights, *ws)
    with jax.set_mesh(mesh):
        got, got_grads = jax.jit(grad(sharded))(x, experts, weights, *ws)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    capacity = expert_parallel.expert_capacity(N * K, EP * N * K)
    assert capacity < EP * N * K  # the fast path exists at this shape
    received_on_rank_0 = int(jnp.sum(experts // (E // EP) == 0))
    assert (received_on_rank_0 > capacity) == (routing == "all_to_rank_0")
