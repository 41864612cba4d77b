"""titan-jax's Qwen3-MoE against torchtitan 0.3.0's own MoE (router, token dispatcher, grouped
experts) on the same HF weights, fp32, forward only (torchtitan has no CPU backward): with an
expert bias, without gate renormalisation, and from transformers 5's fused expert layout."""

import jax.numpy as jnp
import numpy as np
import pytest

from titan_jax.models.qwen3 import build_model_def
from titan_jax.models.qwen3.hf import load_hf_params
from titan_jax.models.qwen3.hf_config import read_hf_config
from titan_jax.parity import metrics

SEQ = 128


@pytest.fixture(scope="module")
def unnormalised_moe(tmp_path_factory, torchtitan_available):
    """(model, path): a HF Qwen3-MoE with norm_topk_prob=False, saved in the hub's layout."""
    from hf_fixtures import random_hf_moe_model

    model = random_hf_moe_model(SEQ, norm_topk_prob=False, seed=1)
    path = tmp_path_factory.mktemp("hf_moe_unnormalised")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def titan_logits(path, tokens_T, expert_bias_LE=None):
    args = read_hf_config(path)
    model = build_model_def(args)
    buffers = (
        model.init_buffers()
        if expert_bias_LE is None
        else {"expert_bias": jnp.asarray(expert_bias_LE)}
    )
    h, w, _ = model.forward(load_hf_params(path, args), buffers, jnp.asarray(tokens_T)[None])
    return np.asarray(jnp.einsum("btd,dv->btv", h, w))[0]


def test_forward_with_an_expert_bias_and_no_renormalisation_equals_torchtitan(unnormalised_moe):
    from titan_jax.parity import torchtitan_ref

    _, path = unnormalised_moe
    args = read_hf_config(path)
    assert not args.norm_topk_prob
    tokens = np.random.default_rng(0).integers(0, args.vocab_size, SEQ).astype(np.int32)
    # Probabilities of this model are peaky: a bias of this size moves many tokens' picks.
    bias = (
        np.random.default_rng(1)
        .normal(0, 0.3, (args.n_layers, args.num_experts))
        .astype(np.float32)
    )
    for expert_bias in (None, bias):
        reference = torchtitan_ref.logits(
            torchtitan_ref.load_model(args, path, SEQ, expert_bias), tokens
        )
        ours = titan_logits(path, tokens, expert_bias)
        assert np.abs(ours - reference).max() <= 1e-4
        assert metrics.kl_per_token(reference, ours).max() <= 1e-9
    unbiased = titan_logits(path, tokens)
    assert np.abs(ours - unbiased).max() > 1e-2  # the bias took part: it changed the picks


def test_files_in_the_fused_layout_load_per_expert(unnormalised_moe, tmp_path):
    from safetensors.torch import save_file

    from titan_jax.parity import torchtitan_ref

    model, path = unnormalised_moe
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers 5's live layout
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    args = read_hf_config(path)
    tokens = np.arange(SEQ, dtype=np.int32) % args.vocab_size
    fused = torchtitan_ref.logits(torchtitan_ref.load_model(args, tmp_path, SEQ), tokens)
    hub = torchtitan_ref.logits(torchtitan_ref.load_model(args, path, SEQ), tokens)
    np.testing.assert_array_equal(fused, hub)
