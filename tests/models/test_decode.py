"""Tests for titan_jax/models/qwen3/decode.py: the KV-cached decoder against the training model
and against HF transformers' `generate`."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TIED, UNTIED

from titan_jax.models.qwen3 import Qwen3Args, build_model_def, decode, hf

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

MOE = Qwen3Args(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=64,
    max_seq_len=64,
    tie_embeddings=False,
    num_experts=4,
    top_k=2,
    moe_inter_dim=24,
)


def random_params(args, seed=0):
    """Random weights with norms away from 1 (so a misplaced norm shows)."""
    model = build_model_def(args)
    params = jax.jit(model.init)(jax.random.key(seed))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [
        x + 0.2 * jax.random.normal(k, x.shape) if x.ndim <= 2 and x.shape[-1] <= 32 else x
        for x, k in zip(leaves, keys, strict=True)
    ]
    return model, jax.tree.unflatten(tree, leaves)


@pytest.mark.parametrize("args", [UNTIED, TIED, MOE], ids=["untied", "tied", "moe"])
def test_cached_decoding_equals_the_training_model(args):
    model, params = random_params(args)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, args.vocab_size)
    full = model.apply(params, tokens)
    cache = decode.init_cache(args, 2, 16, jnp.float32)
    prefill, cache = decode.forward(params, args, tokens[:, :8], jnp.int32(0), cache)
    np.testing.assert_allclose(prefill, full[:, :8], atol=2e-5)
    for pos in range(8, 12):  # then one token at a time, from the cache
        step, cache = decode.forward(params, args, tokens[:, pos : pos + 1], jnp.int32(pos), cache)
        np.testing.assert_allclose(step[:, 0], full[:, pos], atol=2e-5)


def test_sampling():
    logits = jnp.array([[0.0, 3.0, 1.0, 2.9]])
    key = jax.random.key(0)
    assert decode.sample(logits, key, temperature=0.0, top_p=1.0).tolist() == [1]
    # top_p below the top token's probability keeps only that token.
    draws = {int(decode.sample(logits, jax.random.key(i), 1.0, 0.3)[0]) for i in range(20)}
    assert draws == {1}
    draws = {int(decode.sample(logits, jax.random.key(i), 1.0, 0.9)[0]) for i in range(50)}
    assert draws == {1, 3}  # the two likely tokens reach 0.9 together; 0 and 2 are cut


def test_generate_stops_at_eos_and_checks_length():
    _, params = random_params(UNTIED)
    prompt = jnp.array([[1, 2, 3]], jnp.int32)
    greedy = decode.generate(params, UNTIED, prompt, 6)
    assert greedy.shape == (1, 9) and greedy[0, :3].tolist() == [1, 2, 3]
    eos = int(greedy[0, 4])  # make the second generated token the EOS
    stopped = decode.generate(params, UNTIED, prompt, 6, eos_id=eos)
    assert stopped[0].tolist() == greedy[0, :5].tolist()
    with pytest.raises(ValueError, match=f"exceeds the model's max_seq_len={UNTIED.max_seq_len}"):
        decode.generate(params, UNTIED, prompt, UNTIED.max_seq_len - 2)


@pytest.mark.parametrize("args", [UNTIED, TIED], ids=["untied", "tied"])
def test_greedy_equals_hf_generate(tmp_path, args):
    try:
        import torch
        from hf_fixtures import random_hf_model
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"needs the parity extra: {e}")
    model = random_hf_model(args)
    model.save_pretrained(str(tmp_path))
    params = hf.load_hf_params(tmp_path, args)
    prompt = np.random.default_rng(0).integers(0, args.vocab_size, (2, 7))
    n = 24
    with torch.no_grad():
        expected = model.generate(
            torch.tensor(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    ours = decode.generate(params, args, jnp.asarray(prompt, jnp.int32), n)
    assert np.asarray(ours).tolist() == expected.numpy().tolist()
