"""Direct Preference Optimization: the loss of TRL's DPOTrainer (1.16) on preference pairs.

A row holds one pair (data/pairs.py): the chosen sequence (segment `CHOSEN`) and the rejected
one (`REJECTED`), labels on their completions only. A sequence's log-probability is the sum of
its completion tokens' log-probabilities, under the policy (the params trained) and under the
reference (frozen): with LoRA the same weights with the adapters off (`lora.adapters_off`, as
TRL disables PEFT's adapters), else the copy of the initial params the train state keeps
(`keeps_reference`). Per pair, with the log-ratios c = pi(chosen) - ref(chosen) and
r = pi(rejected) - ref(rejected):
  sigmoid (DPO):  -log sigmoid(beta (c - r))
  ipo (IPO):      (c / n_c - r / n_r - 1 / (2 beta))^2, n the completions' token counts (TRL
                  averages the log-ratios over the completion's tokens for IPO).
The step's loss is the mean over the pairs of the whole batch (every microbatch and data
shard); a pair whose chosen or rejected sequence kept no completion token (cut by the row's
length) is not counted. Metrics as TRL logs them: rewards (beta x log-ratio) of the chosen and
rejected, their margin and how often the chosen's is higher, the policy's log-probabilities.
LoRA dropout (`lora.dropout`) is on the policy's forward only, as TRL's with
`disable_dropout=False` (its default, True, sets PEFT's lora_dropout to 0: `lora.dropout=0`);
the reference's log-probabilities are always dropout-free.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.data.pairs import CHOSEN, REJECTED
from titan_jax.data.windows import IGNORE_INDEX
from titan_jax.models.lora import adapters_off
from titan_jax.models.sharding_hooks import ParamTrees
from titan_jax.models.spec import ModelDef, Params
from titan_jax.train.loss import token_log_probs

LOSS_TYPES = ("sigmoid", "ipo")


def pair_count(inputs: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's count of trained tokens in its chosen and in its rejected sequence (B,)."""
    segments, trained = inputs[..., 1], labels != IGNORE_INDEX
    return (
        jnp.sum(trained & (segments == CHOSEN), axis=-1).astype(jnp.float32),
        jnp.sum(trained & (segments == REJECTED), axis=-1).astype(jnp.float32),
    )


def sequence_log_probs(
    token_logps_BT: jax.Array, segments_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per row: the summed log-probabilities of the chosen and of the rejected sequence (B,)
    (ignored labels' are 0)."""
    return (
        jnp.sum(jnp.where(segments_BT == CHOSEN, token_logps_BT, 0.0), axis=-1),
        jnp.sum(jnp.where(segments_BT == REJECTED, token_logps_BT, 0.0), axis=-1),
    )


def dpo_losses(
    loss_type: str,
    beta: float,
    chosen_logratios: jax.Array,
    rejected_logratios: jax.Array,
    n_chosen: jax.Array,
    n_rejected: jax.Array,
) -> jax.Array:
    """The per-pair loss of `loss_type` (TRL 1.16's formulas; the module docstring)."""
    if loss_type == "sigmoid":
        return -jax.nn.log_sigmoid(beta * (chosen_logratios - rejected_logratios))
    if loss_type == "ipo":
        delta = chosen_logratios / jnp.maximum(n_chosen, 1.0) - rejected_logratios / jnp.maximum(
            n_rejected, 1.0
        )
        return (delta - 1 / (2 * beta)) ** 2
    raise ValueError(f"dpo.loss_type={loss_type!r}; valid: {', '.join(LOSS_TYPES)}")


@dataclasses.dataclass(frozen=True)
class DPO:
    """The DPO objective (train/objective.py's `Objective`)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    keeps_reference: bool = True  # full DPO; False: LoRA, the reference is the adapters off

    def count(self, inputs: jax.Array, labels: jax.Array) -> jax.Array:
        """The pairs whose two sequences kept completion tokens."""
        n_chosen, n_rejected = pair_count(inputs, labels)
        return jnp.sum((n_chosen > 0) & (n_rejected > 0)).astype(jnp.float32)

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
    ) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
        """(the per-pair losses summed over these rows, the policy forward's aux stats, sums
        of the metrics over the counted pairs). The model's aux loss is never added (a MoE
        router's aux loss is refused with DPO by the config's checks). `dropout_key`: the
        policy's LoRA dropout; the reference forward takes none (it is frozen: TRL computes
        it under no_grad with PEFT's adapters, and so their dropout, disabled)."""
        del aux_loss
        policy, reference = params if isinstance(params, tuple) else (params, adapters_off(params))
        h, w_out, aux = model.forward(policy, buffers, inputs, dtype, dropout_key)
        with jax.named_scope("dpo_policy_logps"):
            logps = token_log_probs(h, w_out, labels)
        with jax.named_scope("dpo_reference"):
            h_ref, w_ref, _ = model.forward(
                jax.lax.stop_gradient(reference), buffers, inputs, dtype
            )
            ref_logps = jax.lax.stop_gradient(token_log_probs(h_ref, w_ref, labels))
        segments = inputs[..., 1]
        chosen, rejected = sequence_log_probs(logps, segments)
        ref_chosen, ref_rejected = sequence_log_probs(ref_logps, segments)
        n_chosen, n_rejected = pair_count(inputs, labels)
        counted = (n_chosen > 0) & (n_rejected > 0)
        chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
        with jax.named_scope("dpo_loss"):
            losses = dpo_losses(
                self.loss_type,
                self.beta,
                chosen_logratios,
                rejected_logratios,
                n_chosen,
                n_rejected,
            )
        chosen_rewards = self.beta * jax.lax.stop_gradient(chosen_logratios)
        rejected_rewards = self.beta * jax.lax.stop_gradient(rejected_logratios)
        total = lambda x: jnp.sum(jnp.where(counted, x, 0.0))  # noqa: E731
        sums = {
            "rewards/chosen": total(chosen_rewards),
            "rewards/rejected": total(rejected_rewards),
            "rewards/accuracies": total((chosen_rewards > rejected_rewards).astype(jnp.float32)),
            "rewards/margins": total(chosen_rewards - rejected_rewards),
            "logps/chosen": total(jax.lax.stop_gradient(chosen)),
            "logps/rejected": total(jax.lax.stop_gradient(rejected)),
        }
        return total(losses), aux["stats"], sums

    def metrics(self, sums: dict[str, jax.Array], count: jax.Array) -> dict[str, jax.Array]:
        """The means over the step's counted pairs, and their number ("pairs")."""
        return {**{k: v / jnp.maximum(count, 1.0) for k, v in sums.items()}, "pairs": count}
