"""What the step minimises: an `Objective`, chosen by the config (`objective_for`), is the one
seam between the step (train/step.py) and its loss.

The step divides the objective's summed loss over the whole batch by its `count` over the
whole batch (all microbatches and data shards): pre-training and SFT's cross-entropy per
trained token (`CrossEntropy`), DPO's loss per preference pair (train/dpo.py). The summed loss
also returns sums for metrics, summed over microbatches and shards like the model's aux stats
and turned into metrics by `metrics(sums, count)`.

`params` of `summed_loss` is the model's params tree, or (policy, reference) where the
objective keeps a frozen reference copy in the train state (`keeps_reference`: full DPO).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from titan_jax.config import Dpo
from titan_jax.models.sharding_hooks import ParamTrees
from titan_jax.models.spec import ModelDef, Params
from titan_jax.train.dpo import DPO
from titan_jax.train.loss import count_valid_tokens, cross_entropy_sum

# (summed loss, the model's aux stats, the objective's sums for metrics)
SummedLossParts = tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]


class Objective(Protocol):
    # The train state holds a frozen copy of the initial params ("reference") for it.
    @property
    def keeps_reference(self) -> bool: ...

    def count(self, inputs: jax.Array, labels: jax.Array) -> jax.Array:
        """What the summed loss is divided by, over these rows (fp32)."""
        ...

    def summed_loss(
        self,
        model: ModelDef,
        params: ParamTrees,
        buffers: Params,
        inputs: jax.Array,
        labels: jax.Array,
        dtype: Any,
        aux_loss: bool = True,
        dropout_key: jax.Array | None = None,
    ) -> SummedLossParts:
        """`aux_loss`: the model's auxiliary loss joins it (training; validation leaves it
        out). `dropout_key`: the trained model's LoRA dropout (training; None: none)."""
        ...

    def metrics(self, sums: dict[str, jax.Array], count: jax.Array) -> dict[str, jax.Array]: ...


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """fp32 cross-entropy over the trained tokens (and the model's aux loss, summed over
    tokens), per trained token: TorchTitan's pre-training loss, and SFT's."""

    keeps_reference: bool = False

    def count(self, inputs: jax.Array, labels: jax.Array) -> jax.Array:
        del inputs
        return count_valid_tokens(labels)

    def summed_loss(
        self,
        model: ModelDef,
        params: ParamTrees,
        buffers: Params,
        inputs: jax.Array,
        labels: jax.Array,
        dtype: Any,
        aux_loss: bool = True,
        dropout_key: jax.Array | None = None,
    ) -> SummedLossParts:
        if isinstance(params, tuple):  # keeps_reference is False: the step passes no reference
            raise TypeError("cross-entropy takes the model's params, not (policy, reference)")
        total, aux = model.forward_loss(
            params, buffers, inputs, labels, _cross_entropy_sum, dtype, dropout_key
        )
        return total + aux["loss"] if aux_loss else total, aux["stats"], {}

    def metrics(self, sums: dict[str, jax.Array], count: jax.Array) -> dict[str, jax.Array]:
        del sums, count
        return {}


CROSS_ENTROPY = CrossEntropy()


def _cross_entropy_sum(h_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array) -> jax.Array:
    with jax.named_scope("loss"):
        return cross_entropy_sum(h_BTD, w_DV, labels_BT)


def objective_for(dpo: Dpo, lora: bool) -> Objective:
    """The run's objective: DPO when `dpo.enable` (the `[dpo]` config; with `lora` its
    reference is the adapters off, else a frozen copy), else cross-entropy."""
    if not dpo.enable:
        return CROSS_ENTROPY
    return DPO(beta=dpo.beta, loss_type=dpo.loss_type, keeps_reference=not lora)
