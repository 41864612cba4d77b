import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY

from titan_jax.config import ConfigError, load_config
from titan_jax.models import BuildOptions
from titan_jax.models.qwen3 import QWEN3, QWEN3_FLAVORS, Qwen3Args, build_model_def
from titan_jax.models.qwen3.args import YarnScaling, get_flavor
from titan_jax.models.qwen3.model import (
    SAVED_ACTIVATIONS,
    Block,
    Kernels,
    apply_rope,
    rope_tables,
)
from titan_jax.models.sharding_hooks import GATHERED_PARAM
from titan_jax.train.plan_decisions import args_overrides
from titan_jax.trees import is_axes, named_leaves

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

# Published totals (HF safetensors metadata counts the tied lm_head twice; these count it once).
PUBLISHED = {
    "0.6B": 596_049_920,
    "1.7B": 1_720_574_976,
    "4B": 4_022_468_096,
    "8B": 8_190_735_360,
    "14B": 14_768_307_200,
    "32B": 32_762_123_264,
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_flavour_param_count_matches_published(flavor):
    model = build_model_def(get_flavor(flavor))  # abstract: nothing is allocated
    assert model.num_params() == PUBLISHED[flavor]


def test_every_flavour_is_checked_and_tied_ones_have_no_lm_head():
    # The MoE flavours' counts are checked in test_moe.py.
    moe = {"debugmodel_moe", "30B-A3B", "235B-A22B"}
    assert set(QWEN3_FLAVORS) == set(PUBLISHED) | {"debugmodel"} | moe
    for name, args in QWEN3_FLAVORS.items():
        params = build_model_def(args).abstract_params
        assert ("lm_head" in params) == (not args.tie_embeddings), name
    assert build_model_def(get_flavor("debugmodel")).num_params() == 31_987_968


def test_unknown_flavour_is_a_clear_error():
    with pytest.raises(ValueError, match=r"model.flavor='8b'.*did you mean 8B"):
        get_flavor("8b")


def test_logical_axes_cover_every_dimension():
    model = build_model_def(get_flavor("8B"))
    axes = named_leaves(model.logical_axes, is_leaf=is_axes)
    for name, sds in named_leaves(model.abstract_params).items():
        assert len(axes[name]) == len(sds.shape), name
    assert axes["layers.attention.wq"] == ("layers", "embed", "heads", "head_dim")
    assert axes["tok_embeddings"] == ("vocab", "vocab_embed")


def test_causality_future_tokens_get_zero_gradient():
    args = dataclasses.replace(TINY, tie_embeddings=False)  # tied: the table is also lm_head
    model = build_model_def(args)
    params = model.init(jax.random.key(0))
    t, probe = 12, 5
    tokens = jax.random.randint(jax.random.key(1), (1, t), 0, args.vocab_size)
    embeds = jnp.take(params["tok_embeddings"], tokens, axis=0)

    def loss_at(embeds_in):
        # Position i reads row i: the gradient w.r.t. each position's input embedding.
        p = dict(params, tok_embeddings=embeds_in[0])
        logits = model.apply(p, jnp.arange(t)[None])
        return logits[0, probe].sum()

    grad = jax.grad(loss_at)(embeds)
    per_position = np.abs(np.asarray(grad[0])).sum(-1)
    assert np.all(per_position[probe + 1 :] == 0.0)
    assert np.all(per_position[: probe + 1] > 0.0)


def test_rope_is_rotate_half_and_preserves_norm():
    pos = jnp.arange(6)[None]
    cos, sin = rope_tables(pos, 8, 1e6)
    x = jax.random.normal(jax.random.key(0), (1, 6, 2, 8))
    y = apply_rope(x, cos, sin)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(y[:, 0], x[:, 0])  # position 0 is unrotated
    # rotate-half: pairs (i, i + d/2) rotate by angle pos * theta^(-2i/d).
    angle = 3 * 1e6 ** (-2 * 1 / 8)
    x1, x2 = x[0, 3, 0, 1], x[0, 3, 0, 5]
    np.testing.assert_allclose(y[0, 3, 0, 1], x1 * np.cos(angle) - x2 * np.sin(angle), rtol=1e-5)
    np.testing.assert_allclose(y[0, 3, 0, 5], x2 * np.cos(angle) + x1 * np.sin(angle), rtol=1e-5)


def test_yarn_keys_of_the_model_section_reach_the_args_and_survive_json():
    config = load_config(
        None,
        [
            "--model.rope_type",
            "yarn",
            "--model.yarn_factor",
            "2",
            "--model.yarn_original_max_position_embeddings",
            "64",
        ],
    )
    args = QWEN3.configure(TINY, args_overrides(config))
    assert args.yarn == YarnScaling(factor=2.0, original_max_position_embeddings=64)
    assert args.yarn.cos_sin_scale == pytest.approx(0.1 * np.log(2) + 1)
    assert Qwen3Args(**json.loads(json.dumps(dataclasses.asdict(args)))) == args  # model_io
    default = args_overrides(load_config(None, []))
    assert QWEN3.configure(args, default) == args  # "default": the args' own
    cos, _ = rope_tables(jnp.arange(3), 8, 1e6, args.yarn)
    np.testing.assert_allclose(cos[0], args.yarn.cos_sin_scale)  # HF scales the tables
    with pytest.raises(ConfigError, match=r"^model.yarn_factor=0.5 must be >= 1$"):
        load_config(None, ["--model.rope_type", "yarn", "--model.yarn_factor", "0.5"])


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("beta_fast", "0", r"model.yarn_beta_fast=0.0 must be > beta_slow=1.0 \(the ramp"),
        ("beta_slow", "-1", r"model.yarn_beta_slow=-1.0 must be > 0"),
        (
            "factor",
            "1e300",
            r"model.yarn_factor=1e\+300 times original_max_position_embeddings="
            r"32768 exceeds 2147483647 positions",
        ),
        (
            "original_max_position_embeddings",
            "0",
            r"model.yarn_original_max_position_embeddings=0 "
            r"must be in \[1, 2147483647\]",
        ),
    ],
)
def test_yarn_keys_are_range_checked_as_hf_defines_them(key, value, message):
    """beta_fast > beta_slow > 0 (log(0) and an inverted ramp give NaN or wrong frequencies),
    positions that int32 holds: the same rule as a HF config.json's rope_parameters."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(None, ["--model.rope_type", "yarn", f"--model.yarn_{key}", value])


# MoE: the experts' matmul outputs are named too (moe.MOE_SAVED_ACTIVATIONS).
TINY_MOE = dataclasses.replace(TINY, num_experts=4, top_k=2, moe_inter_dim=16)


def _remat_loss_and_grads(args, mode: str | None):
    """Jitted loss and gradients of a model built with remat `mode` (None: no remat), on fixed
    params and tokens (op by op, each took several seconds)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, args.vocab_size)
    base, _, offloaded = (mode or "none").partition("+")  # "full+input": its layer inputs too
    model = build_model_def(
        args, BuildOptions(remat_mode=base, offload_layer_input=bool(offloaded))
    )
    assert (model.remat is not None) == (mode is not None)
    params = build_model_def(args).init(jax.random.key(0))
    return jax.jit(jax.value_and_grad(lambda p: model.apply(p, tokens).std()))(params)


@functools.cache
def _no_remat_loss_and_grads(flavor: str):
    return _remat_loss_and_grads({"dense": TINY, "moe": TINY_MOE}[flavor], None)


@pytest.mark.parametrize("mode", ["full", "selective", "offload", "full+input"])
@pytest.mark.parametrize("flavor", ["dense", "moe"])
def test_activation_checkpointing_does_not_change_loss_or_gradients(mode, flavor):
    """Each remat preset against no remat. "offload" (and "+input": the layer inputs
    offloaded) built directly runs its real policy (the trainer swaps it for selective on CPU
    devices; XLA:CPU still runs the host copies)."""
    loss, grads = _remat_loss_and_grads({"dense": TINY, "moe": TINY_MOE}[flavor], mode)
    ref_loss, ref_grads = _no_remat_loss_and_grads(flavor)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads
    )


def test_selective_remat_saves_matmul_outputs_and_recomputes_elementwise_ops(capsys):
    """What selective keeps of one block, from JAX's own residual report: the matmul outputs
    backward needs (ffn_out is not needed) and attention's, the weights and the block input;
    nothing unnamed, so every norm, RoPE and SiLU output is recomputed."""
    from flax import nnx
    from jax.ad_checkpoint import print_saved_residuals

    policy = build_model_def(TINY, BuildOptions(remat_mode="selective")).remat
    graphdef, state = nnx.split(Block(TINY, nnx.Rngs(0), Kernels()))
    cos, sin = rope_tables(jnp.arange(4), TINY.head_dim, TINY.rope_theta)

    def block_sum(state, x):
        return nnx.merge(graphdef, state)(x, cos, sin)[0].sum()

    print_saved_residuals(
        jax.checkpoint(block_sum, policy=policy), state, jnp.ones((1, 4, TINY.dim))
    )
    lines = capsys.readouterr().out.strip().splitlines()
    named = {line.split("named '")[1].split("'")[0] for line in lines if "named '" in line}
    assert named == {
        "q_proj",
        "k_proj",
        "v_proj",
        "attn_out",
        "wo_out",
        "ffn_w1",
        "ffn_w3",
        GATHERED_PARAM,
    }, lines
    assert set(SAVED_ACTIVATIONS) >= named - {GATHERED_PARAM}
    unnamed = [
        line
        for line in lines
        if "named '" not in line and not line.endswith(("from the argument x", "from a constant"))
    ]
    assert not unnamed, lines


def test_full_remat_of_a_moe_block_saves_its_routing_and_no_other_value(capsys):
    """Full remat recomputes the block but keeps the router's picks and gate weights (a few
    numbers a token), so backward does not wait on the recomputed router; nothing else is
    saved but the block's arguments and (as configured) the gathered weights."""
    from flax import nnx
    from jax.ad_checkpoint import print_saved_residuals

    policy = build_model_def(TINY_MOE, BuildOptions(remat_mode="full")).remat
    graphdef, state = nnx.split(Block(TINY_MOE, nnx.Rngs(0), Kernels(expert_kernel="looped")))
    cos, sin = rope_tables(jnp.arange(4), TINY_MOE.head_dim, TINY_MOE.rope_theta)
    bias = jnp.zeros(TINY_MOE.num_experts)

    def block_sum(state, x):
        return nnx.merge(graphdef, state)(x, cos, sin, bias)[0].sum()

    print_saved_residuals(
        jax.checkpoint(block_sum, policy=policy), state, jnp.ones((1, 4, TINY_MOE.dim))
    )
    lines = capsys.readouterr().out.strip().splitlines()
    named = [line for line in lines if "named '" in line and GATHERED_PARAM not in line]
    assert len(named) == 2 and all("named 'moe_routing'" in line for line in named), lines
    assert {line.split("[")[0] for line in named} == {"i32", "f32"}  # picks, gate weights
    unnamed = [
        line
        for line in lines
        if "named '" not in line and not line.endswith(("from the argument x", "from a constant"))
    ]
    assert not unnamed, lines


def test_bf16_weights_are_cast_at_use_and_logits_stay_fp32():
    model = build_model_def(TINY)
    params = model.init(jax.random.key(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    logits32 = model.apply(params, tokens)
    logits16 = model.apply(params, tokens, jnp.bfloat16)
    assert logits16.dtype == jnp.float32
    assert jax.tree.leaves(params)[0].dtype == jnp.float32
    np.testing.assert_allclose(logits16, logits32, atol=5e-2)
