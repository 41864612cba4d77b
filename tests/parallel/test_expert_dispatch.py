"""The expert-parallel exchange (parallel/expert_parallel.py) against every expert run locally:
outputs and gradients, with no overflow (balanced routing: the real rows fit the capacity),
some (one rank receives about three times its share: the first exchange fills it, the rest
overflows) and all (every pick to one rank), through the CPU emulation of the ragged all-to-all,
which takes the offsets and sizes the TPU/GPU `lax.ragged_all_to_all` takes (one
`exchange_plan`); and the emulation against the ragged all-to-all's documented semantics."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titan_jax.models.qwen3.moe import expert_ffn
from titan_jax.parallel import expert_parallel
from titan_jax.parallel.expert_parallel import exchange_for, exchange_plan, ragged_dispatch

EP, E, K, N, D, F = 8, 16, 2, 32, 16, 24  # per rank: N tokens; E // EP experts


def ep_mesh(ep: int) -> jax.sharding.Mesh:
    return jax.make_mesh(
        (ep,), ("ep",), devices=jax.devices()[:ep], axis_types=(jax.sharding.AxisType.Auto,)
    )


def reference_ragged_all_to_all(operands, outputs, slices):
    """`lax.ragged_all_to_all`'s documented semantics, rank by rank, in numpy."""
    results = [o.copy() for o in outputs]
    for src, (input_offsets, send_sizes, output_offsets, _) in enumerate(slices):
        for dst in range(len(operands)):
            rows = operands[src][input_offsets[dst] : input_offsets[dst] + send_sizes[dst]]
            results[dst][output_offsets[dst] : output_offsets[dst] + len(rows)] = rows
    return results


def test_dense_emulation_follows_the_ragged_all_to_all_semantics_with_the_plans_slices():
    ep, m = 4, 6
    counts = np.array([[1, 0, 3, 2], [0, 0, 6, 0], [2, 2, 1, 1], [0, 5, 0, 1]], np.int32)
    picks = np.random.default_rng(1).normal(size=(ep, m, 3)).astype(np.float32)
    plans = [exchange_plan(jnp.asarray(counts), jnp.int32(r)) for r in range(ep)]
    emulate = functools.partial(exchange_for("cpu", m), axis_name="ep")
    exchange = jax.jit(
        jax.shard_map(
            lambda o, out, *a: emulate(o[0], out[0], *(x[0] for x in a))[None],
            mesh=ep_mesh(ep),
            in_specs=P("ep"),
            out_specs=P("ep"),
            check_vma=False,
        )
    )
    operands, rows = picks, ep * m
    for stage in (0, 1):  # dispatch, then combine (back from the received layout)
        slices = [tuple(np.asarray(a) for a in plan[stage]) for plan in plans]
        outputs = np.full((ep, rows, 3), -1.0, np.float32)  # rows nobody writes keep it
        want = reference_ragged_all_to_all(list(operands), list(outputs), slices)
        got = np.asarray(
            exchange(
                operands,
                outputs,
                *(jnp.asarray(np.stack([s[i] for s in slices])) for i in range(4)),
            )
        )
        np.testing.assert_array_equal(got, np.stack(want))
        if stage == 0:  # received: packed source after source, real rows first
            for r, n_real in enumerate(counts.sum(0)):
                assert (got[r, n_real:] == -1).all() and (got[r, :n_real] != -1).all()
        operands, rows = got, m
    np.testing.assert_array_equal(got, picks)  # every row back where it left


def local_moe_out(x, experts, weights, w1, w3, w2):
    """sum_k weights * FFN_{expert}(x), every expert here, weighted after the FFN."""
    n, k = experts.shape
    y = expert_ffn(x[jnp.arange(n * k) // k], experts.reshape(-1), w1, w3, w2, "looped")
    return jnp.einsum("nk,nkd->nd", weights, y.reshape(n, k, -1).astype(jnp.float32))


def exchanged_moe_out(x, experts, weights, w1, w3, w2, exchange, chunks=1):
    """The same, each (token, slot) pick one row through the exchange with its gate weight,
    which scales the FFN's output on the expert's rank; in `chunks` pipelined exchanges."""

    def ffn(rows, ids, gates):
        return expert_ffn(rows, ids, w1, w3, w2, "looped") * gates[:, None]

    n, k = experts.shape
    y = ragged_dispatch(
        x[jnp.arange(n * k) // k],
        experts.reshape(-1),
        weights.reshape(-1),
        E // EP,
        ffn,
        axis="ep",
        ep=EP,
        exchange=exchange,
        chunks=chunks,
    )
    return jnp.sum(y.reshape(n, k, -1), axis=1)


def loss_fns(mesh, chunks):
    def local(x, experts, weights, w1, w3, w2):
        return jnp.sum(jnp.sin(local_moe_out(x, experts, weights, w1, w3, w2)))

    def per_rank(x, experts, weights, w1, w3, w2):
        out = exchanged_moe_out(
            x, experts, weights, w1, w3, w2, exchange_for("cpu", N * K // chunks), chunks
        )
        return jax.lax.psum(jnp.sum(jnp.sin(out)), "ep")

    rows, experts_split = P("ep"), P("ep")
    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        out_specs=P(),
        check_vma=False,
        in_specs=(rows, rows, rows, experts_split, experts_split, experts_split),
    )
    return local, sharded


@functools.cache
def jitted_loss_grads(chunks):
    """(local, sharded) jitted losses and gradients, compiled once for every routing."""
    grad = functools.partial(jax.value_and_grad, argnums=(0, 2, 3, 4, 5))
    return tuple(jax.jit(grad(f)) for f in loss_fns(ep_mesh(EP), chunks))


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("routing", ["balanced", "skewed_to_rank_0", "all_to_rank_0"])
def test_exchange_equals_local_experts_outputs_and_gradients(routing, chunks):
    mesh = ep_mesh(EP)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(EP * N, D)), jnp.float32)
    if routing != "all_to_rank_0":
        experts = np.stack([rng.permutation(E)[:K] for _ in range(EP * N)])
        if routing == "skewed_to_rank_0":  # expert 0 (rank 0) first choice of 60% of tokens
            experts[rng.random(EP * N) < 0.6, 0] = 0
            experts[:, 1] = np.where(
                experts[:, 1] == experts[:, 0], 1 + experts[:, 0], experts[:, 1]
            )
    else:  # experts 0 and 1 live on rank 0: it receives every pick, ep times its share
        experts = np.tile([0, 1], (EP * N, 1))
    experts = jnp.asarray(experts, jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(EP * N, K)), jnp.float32), -1)
    ws = [
        jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))
    ]
    local, sharded = jitted_loss_grads(chunks)
    want, want_grads = local(x, experts, weights, *ws)
    with jax.set_mesh(mesh):
        got, got_grads = sharded(x, experts, weights, *ws)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    m = N * K // chunks  # a rank's picks in one exchange
    capacity = expert_parallel.expert_capacity(m, EP * m)
    assert capacity < EP * m  # the overflow exchange exists at this shape
    # what rank 0 receives in each chunk's exchange (each rank's picks split in order)
    received = (np.asarray(experts).reshape(EP, chunks, m) // (E // EP) == 0).sum((0, 2))
    assert (received.max() > capacity) == (routing != "balanced")
    assert (received.max() < 2 * capacity) == (routing != "all_to_rank_0")


def test_the_first_exchange_fills_each_receiver_source_after_source_up_to_its_capacity():
    """`capped_counts`: each source's picks for a receiver, in expert order, sent while the
    receiver has room; the rest overflow."""
    ep, capacity = 3, 5  # 2 experts a rank
    counts_SDL = np.array(
        [[[1, 1], [3, 0], [0, 0]], [[2, 1], [2, 2], [1, 0]], [[0, 2], [1, 0], [2, 2]]], np.int32
    )
    got = np.asarray(
        expert_parallel.capped_counts(jnp.asarray(counts_SDL.reshape(ep, -1)), ep, capacity)
    ).reshape(counts_SDL.shape)
    want = np.array(
        [
            [[1, 1], [3, 0], [0, 0]],
            [[2, 1], [2, 0], [1, 0]],  # receiver 1 has 2 rows left for source 1
            [[0, 0], [0, 0], [2, 2]],
        ],
        np.int32,
    )  # receiver 0 is full at 5
    np.testing.assert_array_equal(got, want)


def test_ragged_exchange_rows_vary_over_ep_so_no_cotangent_is_summed_over_ranks():
    """The TPU/GPU exchange (`lax.ragged_all_to_all`, which XLA:CPU cannot compile: traced
    only) under a type-checked shard_map: its result takes its output buffer's type, so the
    buffers must vary over `ep`; typed replicated, the backward would psum the rows'
    cotangents over the ranks (other ranks' tokens)."""

    def per_rank(x, experts, weights, w1, w3, w2):
        out = exchanged_moe_out(x, experts, weights, w1, w3, w2, jax.lax.ragged_all_to_all, 2)
        return jax.lax.psum(jnp.sum(out), "ep")

    shapes = [
        ((EP * N, D), jnp.float32),
        ((EP * N, K), jnp.int32),
        ((EP * N, K), jnp.float32),
        ((E, D, F), jnp.float32),
        ((E, D, F), jnp.float32),
        ((E, F, D), jnp.float32),
    ]
    sharded = jax.shard_map(per_rank, mesh=ep_mesh(EP), in_specs=P("ep"), out_specs=P())
    grads = jax.grad(sharded, argnums=(0, 2, 3, 4, 5))
    jaxpr = str(jax.make_jaxpr(grads)(*(jax.ShapeDtypeStruct(s, t) for s, t in shapes)))
    assert jaxpr.count("ragged_all_to_all") >= 2 * 6  # rows, gates, results, both ways
    summed = [
        line
        for line in jaxpr.splitlines()  # of arrays: the loss's scalar is summed
        if "psum_invariant" in line and re.search(r":\w+\[\d", line)
    ]
    assert summed == [], summed


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _static_call(f, x, *closed):
    """`f(x, *closed)` with `f` a static argument, as `_with_overflow` takes the FFN."""
    return f(x, *closed)


def _static_call_fwd(f, x, *closed):
    return _static_call(f, x, *closed), (x, closed)


def _static_call_bwd(f, saved, g):
    x, closed = saved
    tangent = [jnp.issubdtype(c.dtype, jnp.inexact) for c in closed]

    def with_fixed(differentiated):
        given = iter(differentiated)
        return [next(given) if t else c for c, t in zip(closed, tangent, strict=True)]

    differentiated = [c for c, t in zip(closed, tangent, strict=True) if t]
    _, pullback = jax.vjp(lambda x, d: f(x, *with_fixed(d)), x, differentiated)
    d_x, d_closed = pullback(g)
    given = iter(d_closed)
    return (d_x, *(next(given) if t else None for t in tangent))


_static_call.defvjp(_static_call_fwd, _static_call_bwd)


@pytest.mark.parametrize("convert", ["jax", "ours"])
def test_closure_convert_hoists_the_integers_a_remat_would_find_stale(convert):
    """A layer scan under remat whose FFN closes over int8 codes and float scales, passed
    closure-converted as a custom_vjp's static argument (the overflow's FFN): jax's
    `closure_convert` leaves the codes in the function, stale tracers when the remat re-traces
    it in backward, and the step does not lower; ours hoists them, and the gradients are
    autodiff's of the plain layer."""
    closure_convert = jax.closure_convert if convert == "jax" else expert_parallel.closure_convert

    def loss(scales_LF, codes_LDF, x_MD, via_static_call):
        def layer(x_MD, weights):
            scale_F, codes_DF = weights

            def ffn(x):
                return jnp.tanh(x @ (codes_DF.astype(x.dtype) * scale_F))

            if not via_static_call:
                return ffn(x_MD), None
            converted, closed = closure_convert(ffn, x_MD)
            return _static_call(converted, x_MD, *closed), None

        y, _ = jax.lax.scan(jax.checkpoint(layer), x_MD, (scales_LF, codes_LDF))
        return jnp.sum(y)

    keys = jax.random.split(jax.random.key(0), 3)
    scales = jax.random.uniform(keys[0], (2, D), minval=0.01, maxval=0.02)
    codes = jax.random.randint(keys[1], (2, D, D), -127, 128, jnp.int8)
    x = jax.random.normal(keys[2], (4, D))
    grad = jax.jit(jax.grad(loss, argnums=(0, 2)), static_argnums=3)
    if convert == "jax":
        with pytest.raises(TypeError, match="No constant handler for type.*DynamicJaxprTracer"):
            grad.lower(scales, codes, x, True)
        return
    for got, want in zip(grad(scales, codes, x, True), grad(scales, codes, x, False), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
