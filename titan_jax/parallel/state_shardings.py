"""The shardings of a whole train state and of its batches, from the rules table.

Params and buffers are stored as their storage specs say (`ShardingRules.storage_specs`);
optimizer moments inherit their parameter's sharding; scalars (step counters, optimizer counts)
are replicated; a batch is split over the data-parallel axes (and `cp` on its sequence).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from titan_jax.parallel.rules import ShardingRules
from titan_jax.trees import split_by_name


def named_shardings(rules: ShardingRules, specs: Any) -> Any:
    """A tree of PartitionSpecs as NamedShardings on the rules' mesh."""
    return jax.tree.map(
        lambda s: NamedSharding(rules.mesh, s),
        specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def train_state_shardings(
    rules: ShardingRules,
    param_specs: Any,
    buffer_specs: Any,
    optimizer: optax.GradientTransformation,
    abstract_params: Any,
    scalars: Iterable[str],
    trainable: frozenset[str] | None = None,
) -> dict[str, Any]:
    """{"params", "buffers", "opt_state", *scalars}: the train state's shardings; the
    optimizer's state is over the `trainable` params (dotted names; None: all)."""
    param_shardings = named_shardings(rules, param_specs)
    replicated = NamedSharding(rules.mesh, PartitionSpec())
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer.init,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, split_by_name(abstract_params, trainable)[0]),
        split_by_name(param_shardings, trainable)[0],
        transform_non_params=lambda _: replicated,
    )
    return {
        "params": param_shardings,
        "buffers": named_shardings(rules, buffer_specs),
        "opt_state": opt_shardings,
        **{name: replicated for name in scalars},
    }


def batch_sharding(rules: ShardingRules) -> NamedSharding:
    """(batch, seq) token arrays: rows over the data-parallel axes, positions over `cp`."""
    return NamedSharding(rules.mesh, rules.batch_spec)
