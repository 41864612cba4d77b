"""Train states saved in an older layout, read into today's (checkpoints stay resumable).

- Before `applied_updates`: the count of applied updates lived in the optimizer's state, as the
  LR schedule's (`optax.ScaleByScheduleState`), where the optimizer now has an empty state.
(A key with no arrays that a checkpoint lacks, such as a dense model's `buffers` before they
existed, needs nothing: `Checkpointer.restore` leaves it out of the read.)
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from titan_jax.train.step import APPLIED_UPDATES, TrainState
from titan_jax.trees import leaf_name


def schedule_counted(target: dict[str, Any], saved: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A checkpoint from before the train state counted its applied updates kept the count as
    the LR schedule's state in the optimizer's (`ScaleByScheduleState`), where the optimizer
    now has an empty state: (the target reading that state back, without `applied_updates`;
    whether the checkpoint is such)."""
    if APPLIED_UPDATES not in target or any(n.split(".")[0] == APPLIED_UPDATES for n in saved):
        return target, False
    count = target[APPLIED_UPDATES]

    def old(path: tuple, node: Any) -> Any:
        if isinstance(node, optax.EmptyState) and f"opt_state.{leaf_name(path)}.count" in saved:
            return optax.ScaleByScheduleState(count=count)
        return node

    opt_state = jax.tree_util.tree_map_with_path(old, target["opt_state"], is_leaf=_is_empty)
    return {
        **{k: v for k, v in target.items() if k != APPLIED_UPDATES},
        "opt_state": opt_state,
    }, True


def _is_empty(x: Any) -> bool:
    return isinstance(x, optax.EmptyState)


def count_from_schedule(state: TrainState) -> TrainState:
    """The state of a `schedule_counted` checkpoint in today's form."""
    counts = []

    def new(node: Any) -> Any:
        if isinstance(node, optax.ScaleByScheduleState):
            counts.append(node.count)
            return optax.EmptyState()
        return node

    opt_state = jax.tree.map(
        new, state["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)
    )
    return {**state, "opt_state": opt_state, APPLIED_UPDATES: counts[-1]}
