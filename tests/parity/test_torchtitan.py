"""Our LR schedule and FLOPs formula against TorchTitan's own functions (torchtitan 0.3.0)."""

import importlib.metadata

import numpy as np
import pytest

from titan_jax.config import LRScheduler
from titan_jax.models.qwen3 import QWEN3_FLAVORS
from titan_jax.models.qwen3.flops import flops_per_token
from titan_jax.parity import torchtitan_ref
from titan_jax.train.optim import WSDSchedule

STEPS = 100
SCHEDULES = [  # (warmup, decay_ratio, decay_type, min_lr_factor)
    (10, None, "linear", 0.0),  # decay over everything after warmup
    (20, 0.8, "linear", 0.1),
    (5, 0.5, "sqrt", 0.0),
    (0, 0.3, "cosine", 0.2),  # no warmup
    (30, 0.9, "cosine", 0.0),  # warmup + decay > steps: decay is cut
    (150, None, "linear", 0.0),  # warmup > steps: warmup is cut
    (10, 0.0, "linear", 0.0),  # no decay
]


@pytest.mark.parametrize("warmup, decay_ratio, decay_type, min_lr", SCHEDULES)
def test_lr_schedule_equals_torchtitan_at_every_step(
    warmup, decay_ratio, decay_type, min_lr, torchtitan_available
):
    sched = LRScheduler(
        warmup_steps=warmup, decay_ratio=decay_ratio, decay_type=decay_type, min_lr_factor=min_lr
    )
    ours = np.asarray(WSDSchedule.from_config(1.0, sched, STEPS).factor(np.arange(STEPS)))
    theirs = np.asarray(torchtitan_ref.lr_factors(sched, STEPS))
    # Ours runs in fp32 inside the jitted step, theirs in Python floats: equal to within one
    # fp32 ulp of 1.0 (the factor's range is [0, 1]; `1 - progress` rounds at that scale).
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=np.finfo(np.float32).eps)
    assert theirs.min() > 0  # TorchTitan's virtual last step: the LR never reaches 0


@pytest.mark.parametrize("flavor", sorted(QWEN3_FLAVORS))
def test_flops_per_token_equals_torchtitan(flavor, torchtitan_available):
    for seq_len in (128, 4096):
        assert flops_per_token(QWEN3_FLAVORS[flavor], seq_len) == torchtitan_ref.flops_per_token(
            flavor, seq_len
        ), seq_len


def test_missing_or_wrong_torchtitan_is_reported_with_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    reason = torchtitan_ref.unavailable_reason.__wrapped__()
    assert "torchtitan is not installed" in reason and "--no-deps torchtitan==0.3.0" in reason
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.2.2")
    reason = torchtitan_ref.unavailable_reason.__wrapped__()
    assert "torchtitan 0.2.2 is installed; parity is pinned to 0.3.0" in reason
