"""The LoRA adapter module of Qwen3's projections and experts (the math: `models/lora.py`).

Dense projections add the adapter's term to their output (`Adapter.__call__`, PEFT's
`LoraLayer`). The MoE experts compute what PEFT's `ParamWrapper` on transformers' fused expert
parameters computes, `x (W + A B * scale)` for each row's expert, as `x W + (x A) B * scale`
(`AdaptedExperts`): the grouped kernels run the adapter's two rank-r products on the rows each
expert holds, so no (experts, in, out) product of A and B is formed, nor, in backward, a
gradient the size of the frozen experts (tgmm's whole weight-gradient pass, a third of the
experts' matmul FLOPs). The CPU kernel, which takes plain weights, folds them (`folded`).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from titan_jax.models.lora import RANK_AXIS, Lora, dropout, init_a, lora_delta, merge_into
from titan_jax.models.sharding_hooks import LogicalAxes, use_param

Array = jax.Array


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=("base", "a", "b"), meta_fields=("scale",)
)
@dataclasses.dataclass(frozen=True)
class AdaptedExperts:
    """The experts' weight W (E, in, out) as used (cast, gathered), with its adapter's A
    (E, in, r) and B (E, r, out): each row x of expert e computes `x W_e + (x A_e) B_e *
    scale`. `shape` is W's, as the kernels read a plain weight's."""

    base: Array
    a: Array
    b: Array
    scale: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    def folded(self) -> Array:
        """`W + A B * scale` (summed in fp32, in W's dtype): for kernels that take plain
        weights."""
        return merge_into(self.base, self.a, self.b, self.scale)

    @staticmethod
    def leaf_axes(axes: LogicalAxes) -> tuple[LogicalAxes, LogicalAxes]:
        """A's and B's logical axes, for W's `axes` (expert, in, out): the rank dim unsplit."""
        expert, in_axis, out_axis = axes
        return (expert, in_axis, None), (expert, None, out_axis)


def adapted_matmul(
    matmul: Callable[[Array, Any, Array], Array],
    rank_matmul: Callable[[Array, Array, Array], Array],
    out_matmul: Callable[[Array, Array, Array], Array],
    x_MK: Array,
    w_EKN: Any,
    group_sizes: Array,
    xa_MR: Array | None = None,
) -> Array:
    """`matmul(x, W, group_sizes)`, each row by its expert's weight; for a weight with a LoRA
    adapter beside it (`AdaptedExperts`) plus `(x A) B * scale`, its two rank-r grouped
    products by `rank_matmul` (x A, unless given as `xa_MR`) and `out_matmul` (. B), in x's
    dtype."""
    if not isinstance(w_EKN, AdaptedExperts):
        return matmul(x_MK, w_EKN, group_sizes)
    with jax.named_scope("lora"):
        if xa_MR is None:
            xa_MR = rank_matmul(x_MK, w_EKN.a, group_sizes)
        delta = out_matmul(xa_MR, w_EKN.b, group_sizes)
        delta = delta * jnp.asarray(w_EKN.scale, delta.dtype)
    return matmul(x_MK, w_EKN.base, group_sizes) + delta


def adapted_matmul_pair(
    matmuls: tuple[Callable[..., Array], Callable[..., Array], Callable[..., Array]],
    x_MK: Array,
    weights: tuple[Any, Any],
    group_sizes: Array,
) -> tuple[Array, Array]:
    """`adapted_matmul` (`matmuls`: its first three arguments) of the same rows by two weights
    (the experts' gate and up). Two weights of one joined adapter (`Adapter.beside_experts`:
    the same A) share their `x A`: one rank-r product and, in backward, one pass for A's
    gradient and the rows', where XLA merges no two kernel calls."""
    (w1_EKN, w2_EKN), rank_matmul = weights, matmuls[1]
    project = functools.partial(adapted_matmul, *matmuls, x_MK)
    xa_MR = None
    if isinstance(w1_EKN, AdaptedExperts) and isinstance(w2_EKN, AdaptedExperts):
        if w1_EKN.a is w2_EKN.a:
            with jax.named_scope("lora"):
                xa_MR = rank_matmul(x_MK, w1_EKN.a, group_sizes)
    return project(w1_EKN, group_sizes, xa_MR), project(w2_EKN, group_sizes, xa_MR)


def distinct_leaves(leaves: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Of a flattened pytree: the place of each distinct leaf's first occurrence, and for each
    place the index of its leaf among the distinct ones. A boundary that gives every argument a
    value of its own (an optimization barrier, shard_map's per-shard call) takes the distinct
    leaves once, so that a joined adapter's A, the gate's and the up's, stays one array past
    it, and `adapted_matmul_pair` shares its `x A`."""
    index: dict[int, int] = {}
    firsts: list[int] = []
    for place, leaf in enumerate(leaves):
        if id(leaf) not in index:
            index[id(leaf)] = len(firsts)
            firsts.append(place)
    return firsts, [index[id(leaf)] for leaf in leaves]


def through_once(fn: Callable[[tuple[Array, ...]], tuple[Array, ...]], tree: Any) -> Any:
    """`fn` on the distinct leaves of `tree` (a tuple of arrays in, as many out), the tree
    rebuilt from its results with each leaf shared where the input's was."""
    leaves, treedef = jax.tree.flatten(tree)
    firsts, positions = distinct_leaves(leaves)
    results = fn(tuple(leaves[i] for i in firsts))
    return jax.tree.unflatten(treedef, [results[i] for i in positions])


class Adapter(nnx.Module):
    """LoRA's A (stack..., in..., r) and B (stack..., r, out...) beside one projection's weight
    (stack..., in..., out...), read through the param hook like it; `stack`: leading dims with
    an adapter each (the experts)."""

    def __init__(
        self,
        in_shape: tuple[int, ...],
        in_axes: tuple[str | None, ...],
        out_shape: tuple[int, ...],
        out_axes: tuple[str | None, ...],
        lora: Lora,
        rngs: nnx.Rngs,
        stack_shape: tuple[int, ...] = (),
        stack_axes: tuple[str | None, ...] = (),
        projection: str = "",
    ):
        # A stream of its own: the base weights draw the same keys with or without adapters.
        self.lora_a = nnx.LoRAParam(
            init_a(rngs.lora(), in_shape, lora.rank, stack_shape),
            logical_axes=(*stack_axes, *in_axes, RANK_AXIS),
        )
        self.lora_b = nnx.LoRAParam(
            jnp.zeros((*stack_shape, lora.rank, *out_shape), jnp.float32),
            logical_axes=(*stack_axes, RANK_AXIS, *out_axes),
        )
        self.scale, self.dropout = lora.alpha / lora.rank, lora.dropout
        # Folded into a layer's dropout key: each adapter of a layer draws its own mask.
        self.salt = zlib.crc32(projection.encode())

    @jax.named_scope("lora")
    def __call__(self, rows: Array, dropout_key: Array | None = None) -> Array:
        """The adapter's term for `rows` (R, in...): (R, out...); with the layer's
        `dropout_key` (training), dropout on the rows first, as PEFT's."""
        if dropout_key is not None and self.dropout > 0:
            rows = dropout(rows, jax.random.fold_in(dropout_key, self.salt), self.dropout)
        return lora_delta(
            rows, use_param(self.lora_a, rows.dtype), use_param(self.lora_b, rows.dtype), self.scale
        )

    def beside_experts(self, *weights: Array) -> tuple[AdaptedExperts, ...]:
        """Each expert weight (E, in, out), as used, with the adapter read as they are (cast,
        gathered); several weights: a joined adapter, B's dim after the rank indexes them."""
        a, b = (use_param(p, weights[0].dtype) for p in (self.lora_a, self.lora_b))
        if len(weights) == 1:
            return (AdaptedExperts(weights[0], a, b, self.scale),)
        return tuple(
            AdaptedExperts(w, a, jnp.take(b, i, axis=2), self.scale) for i, w in enumerate(weights)
        )


def adapter_beside(
    lora: Lora,
    projection: str,
    weights: nnx.Param | tuple[nnx.Param, ...],
    n_in: int,
    rngs: nnx.Rngs,
    n_stack: int = 0,
) -> Adapter | None:
    """A LoRA adapter beside `weights` (the HF/PEFT `projection`; several equal weights: one
    adapter joined over them) when `lora` targets it, else None. The weights' first `n_stack`
    dims get an adapter each, their next `n_in` are the input."""
    if not lora.targets(projection):
        return None
    w = weights[0] if isinstance(weights, tuple) else weights
    shape, axes = w.shape, tuple(w.logical_axes)
    ins, outs = slice(n_stack, n_stack + n_in), slice(n_stack + n_in, None)
    out_shape, out_axes = shape[outs], axes[outs]
    if isinstance(weights, tuple) and len(weights) > 1:
        out_shape, out_axes = (len(weights), *out_shape), (None, *out_axes)
    return Adapter(
        shape[ins],
        axes[ins],
        out_shape,
        out_axes,
        lora,
        rngs,
        shape[:n_stack],
        axes[:n_stack],
        projection,
    )
