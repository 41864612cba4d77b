"""Validation: the held-out loss of the current weights, on the training mesh.

`eval_step` is the train step's forward without gradients: the same model call, the same
parallelism (SimpleFSDP's hooks and `loss_map`), the same objective (train/objective.py: the
fp32 summed cross-entropy, aux losses left out; or DPO's loss against the run's reference).
It is jitted once with the training run's parameter and batch shardings, so it needs no
resharding and no second copy of the weights. `Validator` runs it over the `[validation]`
batches (the same batches every time: windows of a held-out token store in order,
`data.windows.ValidationWindows`, with training's document masking; or held-out preference
pairs, `data.pairs.ValidationPairs`; or held-out conversations packed whole,
`data.packing.ValidationConversations`) and returns the loss over all valid tokens, TorchTitan's
reduction, and its perplexity; for DPO, the loss and the metrics over all held-out pairs.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.config import ConfigError, packs_whole_conversations
from titan_jax.data.packing import ValidationConversations
from titan_jax.data.pairs import ValidationPairs
from titan_jax.data.pipeline import holds_pairs, process_barrier, validation_corpus
from titan_jax.data.tokenizer import Tokenizer
from titan_jax.data.windows import HeldOutRows, ValidationWindows
from titan_jax.models.sharding_hooks import Parallelism, ParamTrees
from titan_jax.models.spec import ModelDef, Params
from titan_jax.train.loss import count_valid_tokens
from titan_jax.train.objective import CROSS_ENTROPY, Objective
from titan_jax.train.step import REFERENCE, Batch, TrainState
from titan_jax.train.trainer import Trainer


def eval_step(
    params: Params,
    buffers: Params,
    batch: Batch,
    reference: Params | None = None,
    *,
    model: ModelDef,
    param_dtype: Any,
    parallelism: Parallelism,
    objective: Objective = CROSS_ENTROPY,
) -> dict[str, Any]:
    """{"loss_sum": the objective's summed loss, "count": what it is divided by (valid tokens,
    or pairs), "n_tokens": the valid tokens, "sums": the objective's metric sums}; no
    gradients. `reference`: the frozen params of an objective that keeps them (DPO)."""

    def summed_loss(
        p: ParamTrees, b: Params, inputs: jax.Array, labels: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        total, _, sums = objective.summed_loss(
            model, p, b, inputs, labels, param_dtype, aux_loss=False
        )
        return total, sums

    with parallelism.installed():
        loss_sum, sums = parallelism.loss_map(summed_loss)(
            params if reference is None else (params, reference),
            buffers,
            batch["inputs"],
            batch["labels"],
        )
    return {
        "loss_sum": loss_sum,
        "count": objective.count(batch["inputs"], batch["labels"]),
        "n_tokens": count_valid_tokens(batch["labels"]),
        "sums": sums,
    }


class Validator:
    """Runs validation every `validation.freq` steps (and at the last step)."""

    def __init__(self, trainer: Trainer, tokenizer: Tokenizer):
        config = trainer.plan.config
        v = config.validation  # its seq_len is checked with the model's (run_checks)
        self.config, self.trainer, self.tokenizer = config, trainer, tokenizer
        self.global_batch_size = v.local_batch_size * trainer.plan.degrees.dp
        self.objective = trainer.options.objective
        step = functools.partial(
            eval_step,
            model=trainer.plan.model,
            param_dtype=trainer.options.param_dtype,
            parallelism=trainer.parallelism,
            objective=self.objective,
        )
        self._step = jax.jit(
            step,
            in_shardings=(
                trainer.state_shardings["params"],
                trainer.state_shardings["buffers"],
                trainer.batches.sharding,
                trainer.state_shardings.get(REFERENCE),
            ),
        )
        # Fail before training starts, naming the setting, if there is not one batch.
        first = jax.process_index() == 0
        try:
            corpus = validation_corpus(config, tokenizer, is_first=first, barrier=process_barrier)
        except ValueError as e:  # a bad source or path, named by the data module
            raise ConfigError(f"validation.{e}") from None
        t = config.training  # the document masking training runs with
        rows = trainer.batches.rows(self.global_batch_size)
        self._windows: HeldOutRows
        if holds_pairs(config):
            self._windows = ValidationPairs(
                corpus, seq_len=v.seq_len, global_batch_size=self.global_batch_size, rows=rows
            )
        elif packs_whole_conversations(t):  # conversations whole, as training reads them
            self._windows = ValidationConversations(
                corpus, seq_len=v.seq_len, global_batch_size=self.global_batch_size, rows=rows
            )
        else:
            self._windows = ValidationWindows(
                corpus,
                seq_len=v.seq_len,
                global_batch_size=self.global_batch_size,
                rows=rows,
                document_mask=t.document_mask,
                document_positions=t.document_positions,
            )
        if self._windows.num_batches == 0:
            what = (
                f"{self.global_batch_size} preference pairs"
                if holds_pairs(config)
                else f"{self.global_batch_size} rows of whole conversations"
                if packs_whole_conversations(t)
                else f"{self.global_batch_size} x {v.seq_len + 1} tokens"
            )
            raise ConfigError(
                f"validation.dataset={v.dataset!r} holds less than one batch of {what}; lower "
                "validation.local_batch_size"
                + ("" if holds_pairs(config) else " or validation.seq_len")
            )

    def batches(self, max_batches: int = -1) -> Any:
        """This process's rows of the first `max_batches` (-1: all) validation batches."""
        return self._windows.batches(max_batches)

    def should_validate(self, step: int) -> bool:
        return step % self.config.validation.freq == 0 or step == self.config.training.steps

    def validate(self, state: TrainState) -> dict[str, float]:
        """{"val_loss", "val_perplexity", "val_tokens", "val_batches"} of the state's model
        (DPO: "val_loss" per pair, the objective's metrics as "val_..." and no perplexity).
        Blocks until done: call it before the state is donated to the next step."""
        total: Any = None
        n_batches = 0
        with jax.set_mesh(self.trainer.plan.mesh):
            for local in self.batches(self.config.validation.steps):
                batch = self.trainer.batches.put(local, self.global_batch_size)
                out = self._step(state["params"], state["buffers"], batch, state.get(REFERENCE))
                total = out if total is None else jax.tree.map(jnp.add, total, out)
                n_batches += 1
        total = jax.device_get(total)
        loss = float(total["loss_sum"]) / float(total["count"])
        result = {"val_loss": loss, "val_tokens": int(total["n_tokens"]), "val_batches": n_batches}
        if total["sums"]:  # DPO's metrics, per pair
            metrics = self.objective.metrics(total["sums"], total["count"])
            return {**result, **{f"val_{k}": float(v) for k, v in metrics.items()}}
        return {**result, "val_perplexity": math.exp(min(loss, 700.0))}
