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
    from hf_fixtures import random_hf_model

    def save(args: Qwen3Args, path, seed: int = 0):
        model = random_hf_model(args, seed)
        model.save_pretrained(str(path))
        return path

    return save
