import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY

from titan_jax.models import BuildOptions
from titan_jax.models.qwen3 import QWEN3_FLAVORS, build_model_def
from titan_jax.models.qwen3.args import get_flavor
from titan_jax.models.qwen3.model import apply_rope, rope_tables

# Published totals (HF safetensors metadata counts the tied lm_head twice; these count it once).
PUBLISHED = {"0.6B": 596_049_920, "1.7B": 1_720_574_976, "4B": 4_022_468_096,
             "8B": 8_190_735_360, "14B": 14_768_307_200, "32B": 32_762_123_264}


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
    axes = dict(model.named_leaves(model.logical_axes))
    for name, sds in model.named_leaves(model.abstract_params):
        assert len(axes[name]) == len(sds.shape), name
    assert axes["layers.attention.wq"] == ("layers", "embed", "heads", "head_dim")
    assert axes["tok_embeddings"] == ("vocab", "embed")


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
    assert np.all(per_position[probe + 1:] == 0.0)
    assert np.all(per_position[: probe + 1] > 0.0)


def test_rope_is_rotate_half_and_preserves_norm():
    pos = jnp.arange(6)[None]
    cos, sin = rope_tables(pos, 8, 1e6)
    x = jax.random.normal(jax.random.key(0), (1, 6, 2, 8))
    y = apply_rope(x, cos, sin)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    np.testing.assert_array_equal(y[:, 0], x[:, 0])  # position 0 is unrotated
    # rotate-half: pairs (i, i + d/2) rotate by angle pos * theta^(-2i/d).
    angle = 3 * 1e6 ** (-2 * 1 / 8)
    x1, x2 = x[0, 3, 0, 1], x[0, 3, 0, 5]
    np.testing.assert_allclose(y[0, 3, 0, 1], x1 * np.cos(angle) - x2 * np.sin(angle), rtol=1e-5)
    np.testing.assert_allclose(y[0, 3, 0, 5], x2 * np.cos(angle) + x1 * np.sin(angle), rtol=1e-5)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_activation_checkpointing_does_not_change_gradients(mode):
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, TINY.vocab_size)
    ref = build_model_def(TINY)
    params = ref.init(jax.random.key(0))
    model = build_model_def(TINY, BuildOptions(remat_mode=mode))

    def grads(m):
        return jax.grad(lambda p: m.apply(p, tokens).sum())(params)

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 grads(model), grads(ref))


def test_bf16_weights_are_cast_at_use_and_logits_stay_fp32():
    model = build_model_def(TINY)
    params = model.init(jax.random.key(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    logits32 = model.apply(params, tokens)
    logits16 = model.apply(params, tokens, jnp.bfloat16)
    assert logits16.dtype == jnp.float32
    assert jax.tree.leaves(params)[0].dtype == jnp.float32
    np.testing.assert_allclose(logits16, logits32, atol=5e-2)
