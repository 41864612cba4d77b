"""The whole training step as one pure function, compiled once with `jax.jit`.

forward + loss + backward over a scan of microbatches, global-norm clipping, the optax update,
the model's buffer update and a finite guard, with metrics left on device. This is titan-jax's
Graph Trainer: the compiler sees collectives, remat and the optimizer in one graph.

The step talks to the model only through its interface (`titan_jax/models/spec.py`) and to its
loss only through an `Objective` (train/objective.py, chosen by the config: cross-entropy, or
DPO): the objective's summed loss is divided by its count over the whole batch; the forward's
aux stats are summed over microbatches and shards, turned into metrics, and given to
`update_buffers` after the optimizer. A DPO run's state also holds its frozen reference
params ("reference", no optimizer state), which the step passes through unchanged.

Only the model's trainable params (`ModelDef.trainable`: the LoRA adapters when it has any,
else all) are differentiated and updated, and only they have optimizer state: the others are
split off before `value_and_grad`, so no gradient (nor its reduce-scatter) exists for them,
and they leave the step as they came in. The params stay one nested dict in the state (what
checkpoints and exports read), adapters under their own keys beside their weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from titan_jax.models.lora import dropout_key
from titan_jax.models.sharding_hooks import NO_PARALLELISM, Parallelism, ParamTrees
from titan_jax.models.spec import ModelDef, Params
from titan_jax.planner_hints import expected_branch
from titan_jax.train.loss import count_valid_tokens
from titan_jax.train.objective import CROSS_ENTROPY, Objective
from titan_jax.trees import merge_nested, split_by_name

# {"params", "buffers", "opt_state", "step", "applied_updates"} (+ "reference": DPO's frozen
# params, when the objective keeps one)
TrainState = dict[str, Any]
REFERENCE = "reference"
# The train state's count of optimizer updates applied (skipped, non-finite steps excluded): the
# LR schedule's step. `step` counts every step.
APPLIED_UPDATES = "applied_updates"
Batch = dict[str, jax.Array]  # {"inputs": (B, T) int32, "labels": (B, T) int32}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    n_microbatches: int = 1
    param_dtype: Any = jnp.float32  # weights are cast to this at use
    max_norm: float = 1.0  # 0 disables clipping
    objective: Objective = CROSS_ENTROPY  # what the step minimises (train/objective.py)
    dropout_seed: int | None = None  # LoRA dropout's keys (`lora.dropout_key`); None: off


def init_train_state(
    params: Params,
    buffers: Params,
    optimizer: optax.GradientTransformation,
    trainable: frozenset[str] | None = None,
    keep_reference: bool = False,
) -> TrainState:
    """A fresh state; optimizer state for the `trainable` params only (None: all);
    `keep_reference`: a frozen copy of `params` beside them (DPO's reference model)."""
    state = {
        "params": params,
        "buffers": buffers,
        "opt_state": optimizer.init(split_by_name(params, trainable)[0]),
        "step": jnp.zeros((), jnp.int32),
        APPLIED_UPDATES: jnp.zeros((), jnp.int32),
    }
    if keep_reference:
        # Its own buffers (donating the state donates both); shapes pass as they are.
        state[REFERENCE] = jax.tree.map(
            lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, params
        )
    return state


def split_microbatches(x_BT: jax.Array, n: int) -> jax.Array:
    """(B, T) -> (n, B/n, T), microbatch i = rows i, i+n, i+2n, ...

    Strided rather than contiguous so every microbatch draws rows from every data-parallel
    rank (rows are laid out rank-major), and so the split does not depend on the mesh.
    """
    b = x_BT.shape[0]
    return x_BT.reshape(b // n, n, *x_BT.shape[1:]).swapaxes(0, 1)


def loss_and_grads(
    model: ModelDef,
    params: Params,
    buffers: Params,
    batch: Batch,
    options: StepOptions,
    parallelism: Parallelism = NO_PARALLELISM,
    reference: Params | None = None,
    key: jax.Array | None = None,
) -> tuple[jax.Array, Params, jax.Array, tuple[dict[str, jax.Array], ...]]:
    """(the objective's mean loss over the batch (per valid token for cross-entropy), its
    gradient with respect to the model's trainable params (`ModelDef.trainable`), the
    objective's count, (the forward's aux stats, the objective's metric sums) summed over the
    batch). `reference`: the frozen params the objective compares with (DPO without LoRA).

    `parallelism.loss_map` transforms the summed-loss function before it is differentiated;
    SimpleFSDP maps it over data-parallel shards so that each shard's gradient exists, and is
    cast to the reduce dtype, before it is reduced. Its hooks answer the model's calls over
    the whole differentiation: custom_vjp backward rules (the chunked loss's) are traced after
    the forward has returned, and call them too.
    `key`: the step's dropout key, each microbatch's its index folded in (None: no dropout).
    """
    objective = options.objective
    count = objective.count(batch["inputs"], batch["labels"])
    params, frozen = split_by_name(params, model.trainable)

    def microbatch_loss(
        p: Params, inputs: jax.Array, labels: jax.Array, i: jax.Array
    ) -> tuple[jax.Array, tuple[dict[str, jax.Array], ...]]:
        mb_key = None if key is None else jax.random.fold_in(key, i)

        def summed_loss(
            p: ParamTrees, b: Params, inputs: jax.Array, labels: jax.Array
        ) -> tuple[jax.Array, tuple[dict[str, jax.Array], dict[str, jax.Array]]]:
            total, stats, sums = objective.summed_loss(
                model, p, b, inputs, labels, options.param_dtype, dropout_key=mb_key
            )
            return total, (stats, sums)

        full = merge_nested(p, frozen)
        total, aux = parallelism.loss_map(summed_loss)(
            full if reference is None else (full, reference), buffers, inputs, labels
        )
        # A batch with nothing to learn from (every label ignored; DPO: every pair cut to no
        # completion token) is 0 / 0: non-finite, so the step is skipped, not an update of
        # zero gradients that would still move the moments and decay the weights.
        return total / count, aux

    value_and_grad = jax.value_and_grad(microbatch_loss, has_aux=True)

    def grad_fn(p: Params, inputs: jax.Array, labels: jax.Array, i: jax.Array) -> Any:
        with parallelism.installed():
            return value_and_grad(p, inputs, labels, i)

    if options.n_microbatches == 1:
        (loss, stats), grads = grad_fn(params, batch["inputs"], batch["labels"], jnp.int32(0))
        return loss, grads, count, stats

    def accumulate(
        carry: tuple[jax.Array, Params, Any], mb: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[tuple[jax.Array, Params, Any], None]:
        loss_acc, grads_acc, stats_acc = carry
        (loss, stats), grads = grad_fn(params, *mb)
        return (
            loss_acc + loss,
            jax.tree.map(jnp.add, grads_acc, grads),
            jax.tree.map(jnp.add, stats_acc, stats),
        ), None

    microbatches = (
        split_microbatches(batch["inputs"], options.n_microbatches),
        split_microbatches(batch["labels"], options.n_microbatches),
        jnp.arange(options.n_microbatches, dtype=jnp.int32),
    )
    stats_shape = jax.eval_shape(
        lambda: grad_fn(params, *jax.tree.map(lambda x: x[0], microbatches))[0][1]
    )
    zeros = (
        jnp.zeros((), jnp.float32),
        jax.tree.map(jnp.zeros_like, params),
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape),
    )
    (loss, grads, stats), _ = jax.lax.scan(accumulate, zeros, microbatches)
    return loss, grads, count, stats


def clip_by_global_norm(grads: Params, max_norm: float) -> tuple[Params, jax.Array]:
    """torch.nn.utils.clip_grad_norm_ semantics: scale by min(1, max_norm / (norm + 1e-6))."""
    norm = optax.tree.norm(grads)
    if max_norm <= 0:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale, grads), norm


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    model: ModelDef,
    optimizer: optax.GradientTransformationExtraArgs,
    schedule: Any,
    options: StepOptions,
    parallelism: Parallelism = NO_PARALLELISM,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step. A non-finite loss or grad norm leaves the whole state as it was.

    `parallelism` is where a parallelism plugs in: its hooks answer the model's calls, in
    forward and backward, and its `loss_map` splits the batch's loss (see `loss_and_grads`).
    """
    params, buffers, opt_state = state["params"], state["buffers"], state["opt_state"]
    reference = state.get(REFERENCE)
    key = None if options.dropout_seed is None else dropout_key(options.dropout_seed, state["step"])
    loss, grads, count, (stats, sums) = loss_and_grads(
        model, params, buffers, batch, options, parallelism, reference, key
    )
    n_tokens = count_valid_tokens(batch["labels"])
    params, frozen = split_by_name(params, model.trainable)
    grads, grad_norm = clip_by_global_norm(grads, options.max_norm)
    lr = schedule(state[APPLIED_UPDATES])  # this update's LR, the one logged

    def update(old: tuple[Params, Params, Any]) -> tuple[optax.Params, Params, Any]:
        params, buffers, opt_state = old
        updates, new_opt_state = optimizer.update(grads, opt_state, params, learning_rate=lr)
        # The buffers after the optimizer, as TorchTitan.
        return (
            optax.apply_updates(params, updates),
            model.update_buffers(buffers, stats),
            new_opt_state,
        )

    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # A conditional, not a select per leaf: XLA then updates the donated state in place. With
    # `where(finite, new, old)` the old Adam moments are read by two fusions (the parameter's
    # and the moment's own) and copied first: 2 x the parameters' bytes of temporaries.
    new_params, new_buffers, new_opt_state = jax.lax.cond(
        finite, expected_branch(update), lambda old: old, (params, buffers, opt_state)
    )
    new_state = {
        "params": merge_nested(new_params, frozen),
        "buffers": new_buffers,
        "opt_state": new_opt_state,
        "step": state["step"] + 1,
        APPLIED_UPDATES: state[APPLIED_UPDATES] + finite.astype(jnp.int32),
    }
    if reference is not None:
        new_state[REFERENCE] = reference
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "n_tokens": n_tokens,
        "finite": finite,
        **model.aux_metrics(stats, n_tokens),
        **options.objective.metrics(sums, count),
    }
    return new_state, metrics
