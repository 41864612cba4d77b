"""Fixtures of the parity tests: the PyTorch side's availability and HF checkpoints to compare on.

CI installs the `parity` extra (torch, transformers, torchtitan), so there a missing package
fails the test; elsewhere the test is skipped with the reason.
"""

import os

import pytest

from titan_jax.models.qwen3 import Qwen3Args


def _require(reason: str | None) -> None:
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must have the parity extra: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def hf_available() -> None:
    from titan_jax.parity.run import hf_unavailable_reason

    _require(hf_unavailable_reason())


@pytest.fixture(scope="session")
def torchtitan_available(hf_available) -> None:
    from titan_jax.parity import torchtitan_ref

    _require(torchtitan_ref.unavailable_reason())


@pytest.fixture(scope="session")
def save_hf_checkpoint(hf_available):
    """save(args, path, seed=0): a random transformers Qwen3ForCausalLM written to `path`.

    Norm weights are randomised too: at their init value 1 a norm read from the wrong place
    would go unnoticed."""
    import torch
    import transformers

    def save(args: Qwen3Args, path, seed: int = 0):
        config = transformers.Qwen3Config(
            vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
            num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
            num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
            tie_word_embeddings=args.tie_embeddings, rms_norm_eps=args.norm_eps,
            max_position_embeddings=args.max_seq_len,
            rope_parameters={"rope_theta": args.rope_theta, "rope_type": "default"})
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(config).float()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
        model.save_pretrained(str(path))
        return path

    return save
