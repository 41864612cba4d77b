"""Validation: the held-out loss of the current weights, on the training mesh.

`eval_step` is the train step's forward without gradients: the same model call, the same
parallelism (SimpleFSDP's hooks and `loss_map`), the same fp32 summed cross-entropy (aux
losses left out). It is jitted once with the training run's parameter and batch shardings, so
it needs no resharding and no second copy of the weights. `Validator` runs it over the
`[validation]` batches (the same batches every time: windows of a held-out token store in
order, `data.windows.ValidationWindows`, with training's document masking) and returns the
loss over all valid tokens, TorchTitan's reduction, and its perplexity.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.config import ConfigError
from titan_jax.data.pipeline import process_barrier, validation_corpus
from titan_jax.data.tokenizer import Tokenizer
from titan_jax.data.windows import ValidationWindows
from titan_jax.models.sharding_hooks import Parallelism
from titan_jax.models.spec import Aux, ModelDef, Params
from titan_jax.train.loss import count_valid_tokens, cross_entropy_sum
from titan_jax.train.step import Batch
from titan_jax.train.trainer import Trainer


def eval_step(params: Params, buffers: Params, batch: Batch, *, model: ModelDef,
              param_dtype: Any, parallelism: Parallelism) -> dict[str, jax.Array]:
    """{"loss_sum": summed fp32 CE over valid tokens, "n_tokens": their count}; no gradients."""

    def summed_loss(p: Params, b: Params, inputs: jax.Array, labels: jax.Array
                    ) -> tuple[jax.Array, Aux]:
        h_BTD, w_DV, aux = model.forward(p, b, inputs, param_dtype)
        return cross_entropy_sum(h_BTD, w_DV, labels), {"loss": aux["loss"], "stats": {}}

    with parallelism.installed():
        loss_sum, _ = parallelism.loss_map(summed_loss)(params, buffers, batch["inputs"],
                                                        batch["labels"])
    return {"loss_sum": loss_sum, "n_tokens": count_valid_tokens(batch["labels"])}


class Validator:
    """Runs validation every `validation.freq` steps (and at the last step)."""

    def __init__(self, trainer: Trainer, tokenizer: Tokenizer):
        config = trainer.config
        v = config.validation  # its seq_len is checked with the model's (run_checks)
        self.config, self.trainer, self.tokenizer = config, trainer, tokenizer
        self.global_batch_size = v.local_batch_size * trainer.degrees.dp
        step = functools.partial(eval_step, model=trainer.model,
                                 param_dtype=trainer.options.param_dtype,
                                 parallelism=trainer.parallelism)
        self._step = jax.jit(step, in_shardings=(trainer.state_shardings["params"],
                                                 trainer.state_shardings["buffers"],
                                                 trainer.batches.sharding))
        # Fail before training starts, naming the setting, if there is not one batch.
        first = jax.process_index() == 0
        try:
            corpus = validation_corpus(config, tokenizer, is_first=first, barrier=process_barrier)
        except ValueError as e:  # a bad source or path, named by the data module
            raise ConfigError(f"validation.{e}") from None
        t = config.training  # the document masking training runs with
        self._windows = ValidationWindows(
            corpus, seq_len=v.seq_len, global_batch_size=self.global_batch_size,
            rows=trainer.batches.rows(self.global_batch_size), document_mask=t.document_mask,
            document_positions=t.document_positions)
        if self._windows.num_batches == 0:
            raise ConfigError(
                f"validation.dataset={v.dataset!r} holds less than one batch of "
                f"{self.global_batch_size} x {v.seq_len + 1} tokens; lower validation."
                "local_batch_size or validation.seq_len")

    def batches(self, max_batches: int = -1) -> Any:
        """This process's rows of the first `max_batches` (-1: all) validation batches."""
        return self._windows.batches(max_batches)

    def should_validate(self, step: int) -> bool:
        return step % self.config.validation.freq == 0 or step == self.config.training.steps

    def validate(self, params: Params, buffers: Params) -> dict[str, float]:
        """{"val_loss", "val_perplexity", "val_tokens", "val_batches"} of the model. Blocks
        until done: call it before the state is donated to the next step."""
        loss_sum = n_tokens = jnp.zeros((), jnp.float32)
        n_batches = 0
        with jax.set_mesh(self.trainer.mesh):
            for local in self.batches(self.config.validation.steps):
                batch = self.trainer.batches.put(local, self.global_batch_size)
                out = self._step(params, buffers, batch)
                loss_sum, n_tokens = loss_sum + out["loss_sum"], n_tokens + out["n_tokens"]
                n_batches += 1
        loss_sum, n_tokens = (float(x) for x in jax.device_get((loss_sum, n_tokens)))
        loss = loss_sum / n_tokens
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
                "val_tokens": int(n_tokens), "val_batches": n_batches}
