"""AdamW and TorchTitan's warmup-stable-decay LR schedule, as optax objects."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from titan_jax.config import LRScheduler, Optimizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WSDSchedule:
    """TorchTitan's `linear_warmup_stable_decay` LambdaLR factor, times the base LR.

    Warmup: (step+1)/warmup. Stable: 1. Decay over `decay_steps`, shaped linear/sqrt/cosine,
    scaled into [min_lr_factor, 1]. `stable_steps` includes TorchTitan's "virtual last step", so
    the last real step's LR is not 0. `step` is the number of optimizer updates done so far.
    """

    lr: float
    warmup_steps: int
    stable_steps: int
    decay_steps: int
    decay_type: str
    min_lr_factor: float

    @classmethod
    def from_config(cls, lr: float, sched: LRScheduler, total_steps: int) -> WSDSchedule:
        warmup = sched.warmup_steps
        if warmup > total_steps:
            log.warning(
                "lr_scheduler.warmup_steps=%d exceeds training.steps=%d; using %d",
                warmup,
                total_steps,
                total_steps,
            )
            warmup = total_steps
        if sched.decay_ratio is None:
            decay = total_steps - warmup
        else:
            decay = min(round(total_steps * sched.decay_ratio), total_steps - warmup)
        stable = total_steps + 1 - warmup - decay
        return cls(lr, warmup, stable, decay, sched.decay_type, sched.min_lr_factor)

    def factor(self, step: jnp.ndarray | int) -> jnp.ndarray:
        step = jnp.asarray(step, jnp.float32)
        warmup_stable = self.warmup_steps + self.stable_steps
        warm = (step + 1) / max(self.warmup_steps, 1)
        progress = (step + 1 - warmup_stable) / max(self.decay_steps, 1)
        progress = jnp.clip(progress, 0.0, 1.0)
        if self.decay_type == "linear":
            decayed = 1 - progress
        elif self.decay_type == "sqrt":
            decayed = 1 - jnp.sqrt(progress)
        elif self.decay_type == "cosine":
            decayed = 0.5 * (1.0 + jnp.cos(math.pi * progress))
        else:
            raise ValueError(f"lr_scheduler.decay_type={self.decay_type!r}")
        decayed = self.min_lr_factor + (1 - self.min_lr_factor) * decayed
        return jnp.where(
            step < self.warmup_steps, warm, jnp.where(step < warmup_stable, 1.0, decayed)
        )

    def __call__(self, step: jnp.ndarray | int) -> jnp.ndarray:
        return self.lr * self.factor(step)


def scale_by_given_learning_rate() -> optax.GradientTransformationExtraArgs:
    """Updates times -`learning_rate`, a keyword argument of each `update`: the step passes the
    schedule's value at the train state's count of applied updates, so no optimizer-internal
    count (which a wrapped optimizer would move) decides the LR."""

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        # Read from `extra`, not a keyword-only parameter: optax's update protocol takes
        # **extra_args only, so a required keyword would not match it.
        learning_rate = extra["learning_rate"]
        return jax.tree.map(lambda u: jnp.asarray(-learning_rate, u.dtype) * u, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def build_optimizer(opt: Optimizer) -> optax.GradientTransformationExtraArgs:
    """AdamW with decoupled weight decay on every parameter (TorchTitan: no no-decay group):
    optax's `adamw` chain, with the LR given at each update (`learning_rate=`).

    Clipping is done by the train step itself (it needs the norm for metrics and the finite
    guard), so it is not part of this chain.
    """
    return optax.chain(
        optax.scale_by_adam(b1=opt.beta1, b2=opt.beta2, eps=opt.eps),
        optax.add_decayed_weights(opt.weight_decay),
        scale_by_given_learning_rate(),
    )
