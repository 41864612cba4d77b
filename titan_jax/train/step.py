"""The whole training step as one pure function, compiled once with `jax.jit`.

forward + loss + backward over a scan of microbatches, global-norm clipping, the optax update
and a finite guard, with metrics left on device. This is titan-jax's Graph Trainer: the
compiler sees collectives, remat and the optimizer in one graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from titan_jax.models.qwen3.build import ModelDef, Params
from titan_jax.models.qwen3.param_use import ParamUse, cast_param, param_use_context
from titan_jax.train.loss import count_valid_tokens, cross_entropy_sum

TrainState = dict[str, Any]  # {"params", "opt_state", "step"}
Batch = dict[str, jax.Array]  # {"inputs": (B, T) int32, "labels": (B, T) int32}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    n_microbatches: int = 1
    param_dtype: Any = jnp.float32  # weights are cast to this at use
    max_norm: float = 1.0  # 0 disables clipping


def init_train_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    return {"params": params, "opt_state": optimizer.init(params),
            "step": jnp.zeros((), jnp.int32)}


def split_microbatches(x_BT: jax.Array, n: int) -> jax.Array:
    """(B, T) -> (n, B/n, T), microbatch i = rows i, i+n, i+2n, ...

    Strided rather than contiguous so every microbatch draws rows from every data-parallel
    rank (rows are laid out rank-major), and so the split does not depend on the mesh.
    """
    b = x_BT.shape[0]
    return x_BT.reshape(b // n, n, *x_BT.shape[1:]).swapaxes(0, 1)


# A batch's summed loss as a function (params, inputs_BT, labels_BT) -> scalar, and a transform
# of it (how parallelism splits the batch's computation).
SummedLoss = Callable[[Params, jax.Array, jax.Array], jax.Array]
LossMap = Callable[[SummedLoss], SummedLoss]


def whole_batch(summed_loss: SummedLoss) -> SummedLoss:
    """The default `loss_map`: the loss of the batch as one computation."""
    return summed_loss


def loss_and_grads(model: ModelDef, params: Params, batch: Batch, options: StepOptions,
                   param_use: ParamUse, loss_map: LossMap = whole_batch
                   ) -> tuple[jax.Array, Params, jax.Array]:
    """Mean loss over all valid tokens of the batch, its gradient, and the token count.

    `loss_map` transforms the summed-loss function before it is differentiated; SimpleFSDP maps
    it over data-parallel shards so that each shard's gradient exists, and is cast to fp32,
    before it is reduced.
    """
    n_tokens = count_valid_tokens(batch["labels"])

    def summed_loss(p: Params, inputs: jax.Array, labels: jax.Array) -> jax.Array:
        h, w_out = model.hidden_states(p, inputs, options.param_dtype)
        return cross_entropy_sum(h, w_out, labels)

    def microbatch_loss(p: Params, inputs: jax.Array, labels: jax.Array) -> jax.Array:
        with param_use_context(param_use):
            return loss_map(summed_loss)(p, inputs, labels) / n_tokens

    grad_fn = jax.value_and_grad(microbatch_loss)
    if options.n_microbatches == 1:
        loss, grads = grad_fn(params, batch["inputs"], batch["labels"])
        return loss, grads, n_tokens

    def accumulate(carry: tuple[jax.Array, Params], mb: tuple[jax.Array, jax.Array]
                   ) -> tuple[tuple[jax.Array, Params], None]:
        loss_acc, grads_acc = carry
        loss, grads = grad_fn(params, *mb)
        return (loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    microbatches = (split_microbatches(batch["inputs"], options.n_microbatches),
                    split_microbatches(batch["labels"], options.n_microbatches))
    (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), microbatches)
    return loss, grads, n_tokens


def clip_by_global_norm(grads: Params, max_norm: float) -> tuple[Params, jax.Array]:
    """torch.nn.utils.clip_grad_norm_ semantics: scale by min(1, max_norm / (norm + 1e-6))."""
    norm = optax.tree.norm(grads)
    if max_norm <= 0:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale, grads), norm


def optimizer_count(opt_state: Any) -> jax.Array:
    """Updates applied so far (the LR schedule's step), read from the schedule's own state."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return counts[-1][1]


def train_step(state: TrainState, batch: Batch, *, model: ModelDef,
               optimizer: optax.GradientTransformation, schedule: Any, options: StepOptions,
               param_use: ParamUse = cast_param, loss_map: LossMap = whole_batch,
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step. A non-finite loss or grad norm leaves params and optimizer as they were.

    `param_use` and `loss_map` are where parallelism plugs in (see `loss_and_grads`).
    """
    params, opt_state = state["params"], state["opt_state"]
    loss, grads, n_tokens = loss_and_grads(model, params, batch, options, param_use, loss_map)
    grads, grad_norm = clip_by_global_norm(grads, options.max_norm)
    # The LR of this update: optax's count before the update (skipped steps do not advance it).
    lr = schedule(optimizer_count(opt_state))
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    new_state = {"params": keep(new_params, params), "opt_state": keep(new_opt_state, opt_state),
                 "step": state["step"] + 1}
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "n_tokens": n_tokens,
               "finite": finite}
    return new_state, metrics
