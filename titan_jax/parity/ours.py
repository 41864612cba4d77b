"""The titan-jax side of a parity run: forward, greedy decode, the train loss and its gradients,
and a trajectory of real train steps. Everything runs in fp32 on one device, through the same
functions training uses (`ModelDef.apply`, `loss_and_grads`, `train_step`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from titan_jax.config import JobConfig
from titan_jax.models.spec import ModelDef, Params
from titan_jax.train.optim import WSDSchedule, build_optimizer
from titan_jax.train.step import StepOptions, init_train_state, loss_and_grads, train_step

FP32 = StepOptions(n_microbatches=1, param_dtype=jnp.float32)


class TitanSide:
    """One model's parameters and the jitted functions parity needs (compiled once per shape)."""

    def __init__(self, model: ModelDef, params: Params):
        self.model, self.params = model, params
        self._apply = jax.jit(functools.partial(model.apply, dtype=jnp.float32))
        self._loss_and_grads = jax.jit(
            lambda p, batch: loss_and_grads(model, p, model.init_buffers(), batch, FP32)[:2]
        )

    def logits(self, tokens_T: np.ndarray) -> np.ndarray:
        """fp32 logits (T, V) of one sequence."""
        return np.asarray(self._apply(self.params, jnp.asarray(tokens_T)[None])[0])

    def greedy(self, prompt: np.ndarray, n: int) -> np.ndarray:
        """prompt + n greedily decoded tokens.

        No KV cache: each step re-runs the forward on one fixed-length buffer (prompt + n - 1
        tokens, not yet decoded ones left 0). Causal attention makes the logits at position p
        independent of what follows p, and the fixed shape compiles once; it is the same shape
        `logits` sees on the decoded sequence minus its last token.
        """
        t = len(prompt)
        buf = np.zeros((1, t + n - 1), np.int32)
        buf[0, :t] = prompt
        out = list(prompt)
        for k in range(n):
            # argmax of every position on device (one small op, one shape): only ints come back.
            predicted = np.asarray(jnp.argmax(self._apply(self.params, jnp.asarray(buf))[0], -1))
            token = int(predicted[t - 1 + k])
            out.append(token)
            if t + k < buf.shape[1]:
                buf[0, t + k] = token
        return np.asarray(out, np.int32)

    def loss_and_grads(self, inputs_T: np.ndarray, labels_T: np.ndarray) -> tuple[float, Params]:
        """The train loss (mean CE over valid tokens) of one sequence and its gradient."""
        batch = {"inputs": jnp.asarray(inputs_T)[None], "labels": jnp.asarray(labels_T)[None]}
        loss, grads = self._loss_and_grads(self.params, batch)
        return float(loss), grads


def train_trajectory(
    model: ModelDef, params: Params, recipe: JobConfig, batches: list[dict[str, np.ndarray]]
) -> tuple[list[float], list[float]]:
    """(loss, lr) of each of len(batches) steps of titan-jax's train step from `params`.

    The recipe's optimizer, WSD schedule (over len(batches) steps) and clipping, fp32 weights,
    one microbatch per step; only the model's trainable params (its LoRA adapters, when it
    has any) are updated. `params` is not consumed (the step donates a copy).
    """
    schedule = WSDSchedule.from_config(recipe.optimizer.lr, recipe.lr_scheduler, len(batches))
    optimizer = build_optimizer(recipe.optimizer)
    options = StepOptions(
        n_microbatches=1, param_dtype=jnp.float32, max_norm=recipe.training.max_norm
    )
    step = jax.jit(
        functools.partial(
            train_step, model=model, optimizer=optimizer, schedule=schedule, options=options
        ),
        donate_argnums=0,
    )
    state = init_train_state(
        jax.tree.map(jnp.copy, params), model.init_buffers(), optimizer, model.trainable
    )
    losses, lrs = [], []
    for batch in batches:
        state, metrics = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
        lrs.append(float(metrics["lr"]))
    return losses, lrs
