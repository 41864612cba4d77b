"""Qwen3-MoE: router semantics, dropless grouped experts, the expert-bias update, flavours."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titan_jax.config import load_config
from titan_jax.models.quantization import NONE
from titan_jax.models.qwen3 import QWEN3_FLAVORS, Qwen3Args, build_model_def, megablox, moe
from titan_jax.models.qwen3.adapter import AdaptedExperts
from titan_jax.models.qwen3.flops import count_params
from titan_jax.models.qwen3.moe import (
    EXPERT_KERNELS,
    dense_reference,
    expert_ffn,
    megablox_swiglu,
    route,
    routed_experts,
    update_expert_bias,
)
from titan_jax.train import run_plan


def numpy_route(x, gate, bias, k, norm):
    logits = x.astype(np.float64) @ gate.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    # Highest biased score first; ties go to the lower expert index (as lax.top_k).
    chosen = np.stack(
        [sorted(range(len(p)), key=lambda e, p=p: (-(p[e] + bias[e]), e))[:k] for p in probs]
    )
    weights = np.take_along_axis(probs, chosen, -1)
    if norm:
        weights /= weights.sum(-1, keepdims=True)
    return chosen, weights


@pytest.mark.parametrize("norm", [True, False])
def test_router_equals_numpy(norm):
    rng = np.random.default_rng(0)
    x, gate = rng.normal(size=(32, 16)), rng.normal(size=(16, 8)) * 0.3
    bias = rng.normal(size=8) * 0.05
    experts, weights, _ = route(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(gate, jnp.float32),
        jnp.asarray(bias, jnp.float32),
        3,
        norm,
    )
    want_e, want_w = numpy_route(x, gate, bias, 3, norm)
    np.testing.assert_array_equal(experts, want_e)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)


def test_router_ties_go_to_the_lower_expert():
    x = jnp.zeros((2, 4))  # every logit 0: all experts tie
    experts, weights, _ = route(x, jnp.ones((4, 6)), jnp.zeros(6), 2, True)
    np.testing.assert_array_equal(experts, [[0, 1], [0, 1]])
    np.testing.assert_allclose(weights, 0.5)


def test_bias_changes_the_choice_but_not_the_weights():
    x = jnp.asarray([[1.0, 0.0]])
    gate = jnp.asarray([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # probs favour expert 0, then 1
    _, _, probs = route(x, gate, jnp.zeros(3), 1, False)
    experts, weights, _ = route(x, gate, jnp.asarray([0.0, 0.0, 1.0]), 1, False)
    assert int(experts[0, 0]) == 2  # the bias pushed expert 2 into the top-1 ...
    np.testing.assert_allclose(weights[0, 0], probs[0, 2])  # ... with its unbiased weight


def expert_case(seed=0, n=48, k=3, e=6, d=8, f=12):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    # Unequal groups, expert 5 never chosen.
    experts = jnp.asarray(
        np.stack(
            [rng.choice(5, k, replace=False, p=[0.5, 0.2, 0.15, 0.1, 0.05]) for _ in range(n)]
        ),
        jnp.int32,
    )
    weights = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
    w1, w3 = (jnp.asarray(rng.normal(size=(e, d, f)) / 3, jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.normal(size=(e, f, d)) / 3, jnp.float32)
    return x, experts, weights, (w1, w3, w2)


# megablox (TPU) runs on CPU only interpreted: its own test below checks it against ragged.
@pytest.mark.parametrize("kernel", sorted(set(EXPERT_KERNELS) - {"megablox"}))
def test_grouped_experts_equal_the_dense_reference_forward_and_gradients(kernel):
    x, experts, weights, ws = expert_case()

    def loss(fn, x, weights, ws):
        y = fn(x, experts, weights, *ws)
        return jnp.sum(jnp.sin(y))

    ours = lambda *a: routed_experts(*a, expert_kernel=kernel)  # noqa: E731
    got = jax.value_and_grad(loss, argnums=(1, 2, 3))(ours, x, weights, ws)
    want = jax.value_and_grad(loss, argnums=(1, 2, 3))(dense_reference, x, weights, ws)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_looped_kernel_leaves_padding_rows_out_and_copies_no_weights_per_block():
    """The CPU kernel: rows past the groups (an exchange buffer's padding, id = E) come out
    zero with zero gradient, and forward + backward keep a few row buffers and the weight
    gradients, never a copy of the weights per block (18 blocks x D x F here: 9 weights)."""
    m, d, f, e = 1024, 64, 128, 2
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.permutation(np.repeat([0, 1, e], [700, 300, m - 1000])), jnp.int32)
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    ws = [
        jnp.asarray(rng.normal(size=s) / 8, jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))
    ]

    def loss(x, *ws):
        return jnp.sum(jnp.sin(expert_ffn(x, ids, *ws, "looped")))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(x, *ws).compile()
    padding = np.asarray(ids) == e
    assert (np.asarray(expert_ffn(x, ids, *ws, "looped"))[padding] == 0).all()
    assert (np.asarray(step(x, *ws)[1][0])[padding] == 0).all()
    rows_bytes, weight_bytes = m * d * 4, e * d * f * 4
    assert step.memory_analysis().temp_size_in_bytes < 6 * rows_bytes + 3 * weight_bytes


def test_expert_bias_update_is_torchtitans_formula():
    counts = np.array([[10.0, 2.0, 6.0, 6.0], [1.0, 1.0, 1.0, 9.0]])
    bias = np.array([[0.0, 0.1, 0.0, -0.1], [0.0, 0.0, 0.0, 0.0]])
    coeff = 1e-3
    delta = coeff * np.sign(counts.mean(-1, keepdims=True) - counts)
    want = bias + delta - delta.mean(-1, keepdims=True)
    np.testing.assert_allclose(
        update_expert_bias(jnp.asarray(bias), jnp.asarray(counts), coeff), want, rtol=1e-6
    )


@pytest.mark.parametrize(
    "flavor, total, active", [("30B-A3B", 30.53e9, 3.35e9), ("235B-A22B", 235.1e9, 22.2e9)]
)
def test_moe_flavours_match_the_published_counts(flavor, total, active):
    counts = count_params(QWEN3_FLAVORS[flavor])
    assert counts["total"] == pytest.approx(total, rel=2e-3)
    assert counts["active"] == pytest.approx(active, rel=5e-3)
    model = build_model_def(QWEN3_FLAVORS[flavor])  # abstract: nothing is allocated
    assert model.num_params() == counts["total"]
    assert model.abstract_buffers["expert_bias"].shape == (QWEN3_FLAVORS[flavor].n_layers, 128)


def test_top_k_above_experts_is_an_error():
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        build_model_def(Qwen3Args(num_experts=8, top_k=9, moe_inter_dim=16))


def test_megablox_swiglu_equals_the_ragged_one_and_zeroes_the_padding_rows():
    """The TPU kernels (Pallas megablox, interpret mode on CPU) against `ragged_dot`, outputs and
    gradients, with padding rows past the groups (an exchange buffer's) coming back zero."""
    x, experts, _, ws = expert_case(n=32, k=2, d=16, f=24)
    rows = x[jnp.arange(64) // 2]
    sizes = jnp.bincount(experts.reshape(-1)[:50], length=ws[0].shape[0]).astype(jnp.int32)
    kernel = functools.partial(megablox_swiglu, interpret=True)
    ragged = EXPERT_KERNELS["ragged"]

    @functools.partial(jax.jit, static_argnums=0)
    def out_and_grads(swiglu, rows, *ws):
        y, vjp = jax.vjp(lambda *a: swiglu(*a, sizes), rows, *ws)
        return y, vjp(jnp.cos(y))  # the gradients of sum(sin(y))

    (got, got_grads), (want, want_grads) = (out_and_grads(f, rows, *ws) for f in (kernel, ragged))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.asarray(got[50:]).any()
    for a, b in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)  # sums of ~50 rows


def adapted_experts_case(kernel: str):
    """Rows, weights and adapters of a small expert layer (gate and up joined: one A, B's dim
    after the rank indexes them), and `beside(rows, *weights, *adapters)` through `kernel`
    with the adapters beside the weights, `folded(...)` through `ragged_dot` on the folded
    weights."""
    x, experts, _, ws = expert_case(n=32, k=2, d=16, f=24)
    rows = x[jnp.arange(64) // 2]
    sizes = jnp.bincount(experts.reshape(-1)[:50], length=ws[0].shape[0]).astype(jnp.int32)
    rng, (e, d, f), r = np.random.default_rng(1), ws[0].shape, 4
    adapters = [
        jnp.asarray(rng.normal(size=shape) / 3, jnp.float32)
        for shape in ((e, d, r), (e, r, 2, f), (e, f, r), (e, r, d))
    ]

    def adapted(w1, w3, w2, a13, b13, a2, b2):
        scale = 0.75
        return (
            AdaptedExperts(w1, a13, b13[:, :, 0], scale),
            AdaptedExperts(w3, a13, b13[:, :, 1], scale),
            AdaptedExperts(w2, a2, b2, scale),
        )

    swiglu = (
        functools.partial(megablox_swiglu, interpret=True)
        if kernel == "megablox"
        else EXPERT_KERNELS[kernel]
    )
    ragged = EXPERT_KERNELS["ragged"]
    beside = lambda rows, *p: swiglu(rows, *adapted(*p), sizes)  # noqa: E731
    folded = lambda rows, *p: ragged(rows, *(w.folded() for w in adapted(*p)), sizes)  # noqa: E731
    return (rows, *ws, *adapters), beside, folded


@pytest.mark.parametrize("kernel", ["ragged", "looped", "megablox"])
def test_a_lora_adapter_beside_the_experts_computes_the_folded_weights_swiglu(kernel):
    """`x W + (x A) B * scale` on each expert's rows computes what PEFT's fused-expert adapter
    does with the folded weight `W + A B * scale`: outputs, and the gradients of the rows, the
    weights and the adapters, for every kernel (megablox interpreted), against `ragged_dot` on
    the folded weights."""
    args, beside, folded = adapted_experts_case(kernel)

    @functools.partial(jax.jit, static_argnums=0)
    def out_and_grads(fn, *args):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(jnp.cos(y))  # the gradients of sum(sin(y))

    (got, got_grads), (want, want_grads) = (out_and_grads(fn, *args) for fn in (beside, folded))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[50:]).any()  # the rows past the groups
    for a, b in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def count_rank_products(monkeypatch, rank: int) -> list[tuple[int, ...]]:
    """The rhs shapes of the `x A` products (rank-wide outputs) that moe's `ragged_dot` is
    asked for from now on."""
    products, counted = [], moe.ragged_dot

    def counting(x, w, *rest, **options):
        products.extend([w.shape] if w.shape[-1] == rank else [])
        return counted(x, w, *rest, **options)

    monkeypatch.setattr(moe, "ragged_dot", counting)
    return products


@pytest.mark.parametrize("kernel", ["ragged", "megablox"])
def test_the_gate_and_up_of_a_joined_adapter_share_their_x_a(kernel, monkeypatch):
    """Gate and up read one A: one rank-r product `x A` for both, one for down (2, not 3;
    in backward, as many passes for A's gradient and the rows')."""
    args, beside, _ = adapted_experts_case(kernel)
    rank = args[4].shape[-1]  # A's (experts, dim, rank)
    if kernel == "ragged":  # the adapter's products: moe's ragged_dot
        products = count_rank_products(monkeypatch, rank)
    else:
        products, counted = [], megablox._rank_gmm
        monkeypatch.setattr(
            megablox, "_rank_gmm", lambda *a, **k: products.append(a[1].shape) or counted(*a, **k)
        )
        # The kernel behind a boundary that, as shard_map's on TPU, gives each argument a
        # tracer of its own: one A passed twice would be two.
        monkeypatch.setattr(
            megablox, "run_per_shard", lambda kernel, args, *axes: jax.jit(kernel)(*args)
        )
    jax.make_jaxpr(beside)(*args)
    assert len(products) == 2, products


@pytest.mark.parametrize("before_router", [True, False])
def test_a_moe_layers_joined_gate_up_adapter_computes_one_x_a(before_router, monkeypatch):
    """Through the whole layer (w1 and w3 tied to the router's input by an optimization
    barrier, or not), gate and up share their `x A`: 2 rank-r products, not 3."""
    from flax import nnx

    from titan_jax.models.lora import Lora

    lora = Lora(rank=4, projections=(moe.GATE_UP, moe.DOWN))
    layer = moe.MoE(16, 4, 24, 2, True, 0.02, "ragged", nnx.Rngs(0, lora=1), lora=lora,
                    gather_before_router=before_router)  # fmt: skip
    products = count_rank_products(monkeypatch, lora.rank)
    jax.make_jaxpr(layer)(jnp.ones((2, 8, 16)), jnp.zeros(4))
    assert len(products) == 2, products


@pytest.mark.parametrize("before_router", [True, False])
def test_the_experts_w1_and_w3_are_gathered_before_the_router_unless_turned_off(before_router):
    """`parallelism.fsdp_expert_gather_before_router` reaches each MoE layer: on (the default),
    an optimization barrier ties w1 and w3, as the forward reads them, to the router's input
    (where the compiled schedule gathers them is `test_moe_recipes_aot.py`'s)."""
    config = load_config(
        "configs/qwen3_debug_moe.toml",
        ["--parallelism.fsdp_expert_gather_before_router", str(before_router).lower()],
    )
    model = build_model_def(
        QWEN3_FLAVORS["debugmodel_moe"], run_plan.build_options(config, "cpu", "xla", NONE)
    )
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    jaxpr = str(jax.make_jaxpr(model.forward)(model.abstract_params, model.init_buffers(), tokens))
    args = model.args
    w_EDF = f"f32[{args.num_experts},{args.dim},{args.moe_inter_dim}]"
    tied = [
        line
        for line in jaxpr.splitlines()
        if "optimization_barrier" in line and line.count(w_EDF) == 2
    ]
    assert len(tied) == (1 if before_router else 0), tied
