"""Dotted names of pytree leaves, shared by the model, checkpoints and reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def leaf_name(path: tuple) -> str:
    """A pytree key path as a dotted name, e.g. "layers.attention.wq"; the same for the live
    state and orbax's metadata tree (which stores tuples as lists, namedtuples as dicts)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{dotted name: leaf} in flattening order."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {leaf_name(p): x for p, x in flat}


def is_axes(x: Any) -> bool:
    """Leaves of a logical-axes tree (tuples of axis names), for `named_leaves(is_leaf=)`."""
    return isinstance(x, tuple)


def nested_get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    """`tree[path[0]][path[1]]...`"""
    for key in path:
        tree = tree[key]
    return tree


def nested_set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """`tree[path[0]]...[path[-1]] = value`, creating the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def split_by_name(
    tree: dict[str, Any], names: frozenset[str] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the nested dict of the leaves whose dotted name is in `names`, that of the others);
    `names` None selects every leaf. `merge_nested` puts them back together."""
    if names is None:
        return tree, {}
    selected, rest = {}, {}
    for name, leaf in named_leaves(tree).items():
        nested_set(selected if name in names else rest, tuple(name.split(".")), leaf)
    return selected, rest


def merge_nested(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The union of two nested dicts whose leaves have different names."""
    merged = dict(a)
    for key, value in b.items():
        merged[key] = merge_nested(merged[key], value) if key in merged else value
    return merged
