import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_model import TINY

from titan_jax.config import LRScheduler, Optimizer
from titan_jax.models.qwen3 import build_model_def
from titan_jax.train.loss import IGNORE_INDEX, cross_entropy_sum
from titan_jax.train.optim import WSDSchedule, build_optimizer
from titan_jax.train.step import (
    StepOptions,
    init_train_state,
    split_microbatches,
    train_step,
)

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py


def make_step(n_microbatches=1, steps=10, max_norm=1.0):
    model = build_model_def(TINY)
    schedule = WSDSchedule.from_config(1e-3, LRScheduler(warmup_steps=2), steps)
    optimizer = build_optimizer(Optimizer())
    step = jax.jit(
        functools.partial(
            train_step,
            model=model,
            optimizer=optimizer,
            schedule=schedule,
            options=StepOptions(n_microbatches=n_microbatches, max_norm=max_norm),
        )
    )
    state = init_train_state(model.init(jax.random.key(0)), model.init_buffers(), optimizer)
    return step, state


def batches(n, rows=8, t=16, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, TINY.vocab_size, (rows, t + 1)).astype(np.int32)
        labels = tokens[:, 1:].copy()
        labels[0, :3] = IGNORE_INDEX  # some ignored tokens change the divisor
        out.append({"inputs": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(labels)})
    return out


def run(step, state, data):
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_gradient_accumulation_4x2_equals_1x8():
    data = batches(5)
    state1, losses1 = run(*make_step(1), data)
    state4, losses4 = run(*make_step(4), data)
    np.testing.assert_allclose(losses4, losses1, rtol=1e-6)
    # Adam divides by sqrt(v): last-bit gradient differences move tiny weights by ~1e-6.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), state4["params"], state1["params"]
    )
    assert losses1[-1] < losses1[0]


def test_loss_is_mean_over_valid_tokens():
    h = jax.random.normal(jax.random.key(0), (2, 3, 4))
    w = jax.random.normal(jax.random.key(1), (4, 5))
    labels = jnp.array([[1, IGNORE_INDEX, 2], [0, 4, IGNORE_INDEX]])
    logits = np.asarray(jnp.einsum("btd,dv->btv", h, w))
    expected = 0.0
    for b, t in [(0, 0), (0, 2), (1, 0), (1, 1)]:
        row = logits[b, t]
        expected += np.log(np.exp(row - row.max()).sum()) + row.max() - row[labels[b, t]]
    np.testing.assert_allclose(cross_entropy_sum(h, w, labels), expected, rtol=1e-5)


def test_microbatches_are_strided_rows():
    x = jnp.arange(8)[:, None]
    np.testing.assert_array_equal(split_microbatches(x, 4)[1, :, 0], [1, 5])


def test_finite_guard_leaves_state_untouched_on_nan():
    step, state = make_step()
    poisoned = jax.tree.map(jnp.copy, state)
    poisoned["params"]["norm"]["weight"] = poisoned["params"]["norm"]["weight"].at[0].set(jnp.nan)
    before = jax.tree.map(np.asarray, poisoned)
    after, metrics = step(poisoned, batches(1)[0])
    assert not bool(metrics["finite"])
    assert not np.isfinite(float(metrics["loss"]))
    for b, a in zip(
        jax.tree.leaves(before["params"]), jax.tree.leaves(after["params"]), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    for b, a in zip(
        jax.tree.leaves(before["opt_state"]), jax.tree.leaves(after["opt_state"]), strict=True
    ):
        np.testing.assert_array_equal(a, b)  # moments and the LR count did not move
    assert int(after["step"]) == 1 and int(after["applied_updates"]) == 0


def test_the_update_writes_the_donated_state_in_place():
    """The finite guard is one conditional around the update: XLA then writes the donated
    Adam moments in place. As a select per leaf it read each old moment twice and copied them
    all first (2 x the parameters' bytes of temporaries)."""
    model = build_model_def(TINY)
    optimizer = build_optimizer(Optimizer())
    step = jax.jit(
        functools.partial(
            train_step,
            model=model,
            optimizer=optimizer,
            options=StepOptions(),
            schedule=WSDSchedule.from_config(1e-3, LRScheduler(warmup_steps=2), 10),
        ),
        donate_argnums=0,
    )
    state = jax.eval_shape(
        lambda: init_train_state(model.init(jax.random.key(0)), model.init_buffers(), optimizer)
    )
    hlo = step.lower(state, batches(1)[0]).compile().as_text()
    assert "mu" in hlo and not re.search(r"copy\(%state__opt_state", hlo)


def test_the_lr_follows_the_count_of_applied_updates():
    """A skipped (non-finite) step counts as a step but not as an update: the next update, and
    the LR it logs, are still the schedule's first."""
    step, state = make_step()
    schedule = WSDSchedule.from_config(1e-3, LRScheduler(warmup_steps=2), 10)
    poisoned = jax.tree.map(jnp.copy, state)
    poisoned["params"]["norm"]["weight"] = poisoned["params"]["norm"]["weight"].at[0].set(jnp.nan)
    skipped, _ = step(poisoned, batches(1)[0])
    skipped["params"] = state["params"]
    data = batches(2)
    after, first = step(skipped, data[0])
    after, second = step(after, data[1])
    assert (int(after["step"]), int(after["applied_updates"])) == (3, 2)
    np.testing.assert_allclose(
        [float(first["lr"]), float(second["lr"])],
        [float(schedule(0)), float(schedule(1))],
        rtol=1e-6,
    )
    # The update applied is the LR's: the same as a run that never skipped.
    clean, _ = step(state, data[0])
    jax.tree.map(np.testing.assert_array_equal, step(clean, data[1])[0]["params"], after["params"])


def test_clipping_scales_to_max_norm():
    """The step clips by `max_norm` (0 disables): Adam's first moment after one step is
    (1 - beta1) x the clipped gradient, so it shrinks by max_norm / (norm + 1e-6), as torch's
    clip_grad_norm_ (which norms below max_norm leave alone: test_clip_by_global_norm...)."""
    max_norm = 1e-3
    batch = batches(1)[0]
    after = {}
    for norm_limit in (0.0, max_norm):
        step, state = make_step(max_norm=norm_limit)
        after[norm_limit], metrics = step(state, batch)
    grad_norm = float(metrics["grad_norm"])  # reported before clipping
    assert grad_norm > 10 * max_norm
    scale = max_norm / (grad_norm + 1e-6)
    mu = {k: optax.tree_utils.tree_get(after[k]["opt_state"], "mu") for k in after}
    jax.tree.map(
        lambda clipped, raw: np.testing.assert_allclose(
            clipped, raw * scale, rtol=1e-5, atol=1e-12
        ),
        mu[max_norm],
        mu[0.0],
    )


def test_clip_by_global_norm_follows_torch():
    from titan_jax.train.step import clip_by_global_norm

    grads = {"a": jnp.full((4,), 3.0)}
    for max_norm, expected in [(0.0, 1.0), (1e-3, 1e-3 / (6.0 + 1e-6)), (10.0, 1.0)]:
        clipped, norm = clip_by_global_norm(grads, max_norm)
        np.testing.assert_allclose(clipped["a"], 3.0 * expected, rtol=1e-6)
        assert float(norm) == pytest.approx(6.0)
