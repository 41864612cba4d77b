import math

import pytest

from titan_jax.config import LRScheduler
from titan_jax.train.optim import WSDSchedule


def factors(total, **kw):
    sched = WSDSchedule.from_config(1.0, LRScheduler(**kw), total)
    return [float(sched(s)) for s in range(total)]


def test_warmup_stable_decay_points():
    # 10 steps, warmup 2, decay_ratio 0.5 -> decay 5, stable 10 + 1 - 2 - 5 = 4.
    f = factors(10, warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.0)
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)
    assert f[2:6] == pytest.approx([1.0] * 4)
    # Decay progress (step + 1 - 6) / 5 for steps 6..9; the virtual last step keeps it > 0.
    assert f[6:] == pytest.approx([0.8, 0.6, 0.4, 0.2])


def test_decay_shapes_and_min_lr():
    lin = factors(10, warmup_steps=0, decay_type="linear", min_lr_factor=0.1)
    sqrt = factors(10, warmup_steps=0, decay_type="sqrt", min_lr_factor=0.0)
    cos = factors(10, warmup_steps=0, decay_type="cosine", min_lr_factor=0.0)
    # No warmup, decay over all 10 steps, stable = 1 (the virtual step): progress = step/10.
    assert lin == pytest.approx([0.1 + 0.9 * (1 - s / 10) for s in range(10)])
    assert sqrt == pytest.approx([1 - math.sqrt(s / 10) for s in range(10)])
    assert cos == pytest.approx([0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(10)])
    assert min(lin) > 0.1


def test_warmup_longer_than_run_is_clamped():
    assert factors(4, warmup_steps=10) == pytest.approx([0.25, 0.5, 0.75, 1.0])
