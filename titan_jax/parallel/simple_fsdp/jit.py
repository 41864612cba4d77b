"""SimpleFSDP's compiler path: sharding constraints inside a vmap over the data shards; GSPMD
places and schedules the collectives.

Why it maps the loss over data shards. Under plain GSPMD a weight's gradient is one
dot contracting the batch-sharded tokens, so the partitioner reduces it right at that dot, in
the dot's dtype: bf16 with bf16 weights. Making that dot fp32 is not enough either: the
gradient is then rounded to the bf16 weight's dtype after the reduction, and the TPU compiler
moves that rounding in front of the all-reduce (seen in a v5p AOT compile: bf16 all-reduces).
So the loss is vmapped over the data shards (`spmd_axis_name`: one shard per device) and every
gathered weight is made per-shard: each shard's gradient then exists on its own, in bf16, and
the gather's backward casts it to fp32 before the cross-shard sum, which GSPMD emits as an
fp32 all-reduce / reduce-scatter with nothing after it to narrow. That is SimpleFSDP's
"cast to reduce dtype, then reduce" exactly. (jax 0.10.2's `reduced`/`unreduced` sharding
types would say "reduce later" directly, but they need Explicit axes and have no rule yet for
`take` or for elementwise ops between a reduced weight and batch-sharded data.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from titan_jax.models.quantization import PrequantizedWeight, WeightQuantization
from titan_jax.models.sharding_hooks import (
    GATHERED_PARAM,
    Kernel,
    LogicalAxes,
    LossAux,
    ParamTrees,
    SummedLoss,
    each_params_tree,
)
from titan_jax.models.spec import Params
from titan_jax.parallel.compiler_workarounds import cast_in_loop, give_shard_dim
from titan_jax.parallel.per_shard import jit_per_shard
from titan_jax.parallel.rules import WeightLayout, mesh_axes_of
from titan_jax.parallel.simple_fsdp.base import SimpleFSDP

# vmap axis names of the data shards: SHARDS over the axes the vocabulary is split over (all
# data axes when it is not split), REPLICAS over the other data axes.
SHARDS, REPLICAS = "data_shards", "data_replicas"


# Hand-written VJP: the gradient is cast to reduce_dtype (fp32) before its cross-shard sum,
# where autodiff would reduce it in the compute dtype. Without it:
# tests/parallel/test_simple_fsdp.py::test_bf16_gathers_and_fp32_gradient_reductions[hsdp2x4-jit]
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def gather_param(
    stored: jax.Array,
    shard_index: jax.Array,
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    storage: NamedSharding,
    compute: NamedSharding,
) -> jax.Array:
    """Inside the vmap over data shards: `stored` cast to `dtype`, all-gathered from `storage`
    to `compute` sharding, as this shard's own copy (`shard_index` is the batched
    `lax.axis_index(SHARDS)`, used only to give the weight the shard dimension)."""
    # Cast on the shard and pin it there: without the pin, propagation moves the cast after the
    # all-gather, which then moves fp32.
    x = lax.with_sharding_constraint(cast_in_loop(stored, dtype), storage)
    x = give_shard_dim(x, shard_index)
    x = lax.with_sharding_constraint(x, compute)  # + the shard dim over the data axes (vmap)
    return checkpoint_name(x, GATHERED_PARAM)


def _gather_param_fwd(
    stored: jax.Array,
    shard_index: jax.Array,
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    storage: NamedSharding,
    compute: NamedSharding,
) -> tuple[jax.Array, None]:
    return gather_param(stored, shard_index, dtype, reduce_dtype, storage, compute), None


def _gather_param_bwd(
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    storage: NamedSharding,
    compute: NamedSharding,
    _: None,
    g: jax.Array,
) -> tuple[jax.Array, None]:
    # g is this shard's gradient. Cast before anything sums it: vmap then sums the shards'
    # gradients of the unbatched `stored` (already in `reduce_dtype`), which GSPMD emits as
    # the reduction.
    return g.astype(reduce_dtype), None


gather_param.defvjp(_gather_param_fwd, _gather_param_bwd)


# Hand-written VJP: the gathered codes carry no gradient, so the port's cotangent is routed
# to the stored shard, cast to reduce_dtype before its cross-shard sum. Without it:
# tests/parallel/test_quantized_gather.py::
# test_quantized_gathers_equal_quantizing_after_the_gather
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def gather_quantized(
    stored: jax.Array,
    shard_index: jax.Array,
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    storage: NamedSharding,
    compute: NamedSharding,
    quantized: WeightQuantization,
) -> PrequantizedWeight:
    """`gather_param` of a weight a quantized matmul reads: `stored` cast to `dtype` and
    quantized on its shard (GSPMD takes each scale's absmax over the shards it spans), its
    codes and scales gathered to `compute`; the port is this shard's own (its gradient
    reduced as `gather_param`'s)."""
    x = lax.with_sharding_constraint(cast_in_loop(stored, dtype), storage)
    codes = quantized.quantize(x, lambda m: m)
    # Quantize on the shard and pin it there, as `gather_param` pins its cast: the codes,
    # not the weight, are what the gather moves.
    values = lax.with_sharding_constraint(codes.qvalue, storage)
    values = lax.with_sharding_constraint(give_shard_dim(values, shard_index), compute)
    scale = give_shard_dim(codes.scale, shard_index)
    scale = lax.with_sharding_constraint(scale, _sharding_of_scale(compute, codes.scale))
    port = give_shard_dim(jnp.zeros(x.shape, dtype), shard_index)
    port = lax.with_sharding_constraint(port, compute)
    return PrequantizedWeight(dataclasses.replace(codes, qvalue=values, scale=scale), port)


def _sharding_of_scale(compute: NamedSharding, scale: jax.Array) -> NamedSharding:
    """`compute` without the splits of the dims a scale spans (size 1)."""
    spec = tuple(compute.spec) + (None,) * (scale.ndim - len(compute.spec))
    kept = [entry if n > 1 else None for entry, n in zip(spec, scale.shape, strict=True)]
    return NamedSharding(compute.mesh, PartitionSpec(*kept))


def _gather_quantized_fwd(
    stored: jax.Array,
    shard_index: jax.Array,
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    storage: NamedSharding,
    compute: NamedSharding,
    quantized: WeightQuantization,
) -> tuple[PrequantizedWeight, None]:
    args = (dtype, reduce_dtype, storage, compute, quantized)
    return gather_quantized(stored, shard_index, *args), None


def _gather_quantized_bwd(
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    storage: NamedSharding,
    compute: NamedSharding,
    quantized: WeightQuantization,
    _: None,
    g: PrequantizedWeight,
) -> tuple[jax.Array, None]:
    return g.port.astype(reduce_dtype), None  # as `_gather_param_bwd`


gather_quantized.defvjp(_gather_quantized_fwd, _gather_quantized_bwd)


class JitSimpleFSDP(SimpleFSDP):
    """SimpleFSDP by sharding constraints (the module docstring says why the vmap)."""

    implementation = "jit"
    # The splash kernel's per-shard shard_map does not trace in the look-ahead scan's backward
    # here (JAX: "vmap spmd_axis_name cannot appear in shard_map out_specs").
    hosts_splash_lookahead = False
    # With HSDP replicas XLA:TPU moves the bf16 cast in front of the split loss's fp32
    # all-reduce of the hidden states' gradient (nested vmaps): the vocabulary tables are
    # gathered instead (`rules.table_for_vocab`), a gradient reduced in bf16 costing more than
    # the vocabulary buffers save.
    splits_vocab_across_replicas = False
    # `loss_map` hands a kept-split weight (the experts under ep) to each shard as its slice,
    # which `_gather` casts and pins to its compute layout: GSPMD gathers the rest of its
    # split in the compute dtype.
    quantizes_kept_splits = False

    def _gather(
        self,
        value: jax.Array,
        logical_axes: LogicalAxes,
        layout: WeightLayout,
        dtype: jnp.dtype,
        kept: bool,
    ) -> jax.Array:
        if kept:  # `loss_map` hands in this shard's slice, used as it is
            return self.constrain(value.astype(dtype), logical_axes)
        return gather_param(
            value,
            self._shard_index(),
            dtype,
            value.dtype,
            NamedSharding(self.mesh, layout.storage),
            NamedSharding(self.mesh, layout.compute),
        )

    def _gather_quantized(
        self,
        value: jax.Array,
        layout: WeightLayout,
        dtype: jnp.dtype,
        quantized: WeightQuantization,
    ) -> PrequantizedWeight:
        return gather_quantized(
            value,
            self._shard_index(),
            dtype,
            value.dtype,
            NamedSharding(self.mesh, layout.storage),
            NamedSharding(self.mesh, layout.compute),
            quantized,
        )

    def _gather_frozen(
        self, value: jax.Array, logical_axes: LogicalAxes, layout: WeightLayout, kept: bool
    ) -> jax.Array:
        if kept:
            return self.constrain(value, logical_axes)
        # No shard dim: nothing differentiates it, so no per-shard gradient is needed.
        x = lax.with_sharding_constraint(value, NamedSharding(self.mesh, layout.storage))
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, layout.compute))

    def constrain(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        spec = self.rules.local_compute_spec("activation", logical_axes)
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec)) if spec else x

    def _vocab_shard_axes(self, axes: tuple[str, ...]) -> str:
        return SHARDS

    def run_per_shard(
        self,
        kernel: Kernel,
        args: tuple[jax.Array, ...],
        in_axes: tuple[LogicalAxes, ...],
        out_axes: LogicalAxes,
    ) -> jax.Array:
        in_specs, out_spec = self._local_specs(in_axes, out_axes)
        return jit_per_shard(self.mesh, kernel, args, in_specs, out_spec)

    def loss_map(self, summed_loss: SummedLoss) -> SummedLoss:
        inner, outer = self._shard_axes()
        n_in = math.prod(self.mesh.shape[a] for a in inner)
        n_out = self.n_shards // n_in
        if outer and self.data_axes.index(outer[-1]) > self.data_axes.index(inner[0]):
            raise ValueError(
                f"the jit path needs the replicated data axes {outer} before "
                f"the vocabulary's {inner} in the batch's order"
            )

        def per_shard(
            params: ParamTrees, buffers: Params, inputs: jax.Array, labels: jax.Array
        ) -> tuple[jax.Array, LossAux]:
            dims = each_params_tree(params, lambda _: self._per_shard_dims())
            per = jax.vmap(
                summed_loss, in_axes=(dims, None, 0, 0), axis_name=SHARDS, spmd_axis_name=inner
            )
            if outer:
                per = jax.vmap(
                    per, in_axes=(None, None, 0, 0), axis_name=REPLICAS, spmd_axis_name=outer
                )

            # Rows are laid out shard-major, so the split moves no data.
            def split(x: jax.Array) -> jax.Array:
                lead = (n_out,) if outer else ()
                return x.reshape(*lead, n_in, x.shape[0] // self.n_shards, *x.shape[1:])

            kept = each_params_tree(params, lambda p: self._split_kept(p, n_in))
            losses, aux = per(kept, buffers, split(inputs), split(labels))
            total = lambda a: jnp.sum(a, axis=(0, 1) if outer else 0)  # noqa: E731
            return total(losses), jax.tree.map(total, aux)

        return per_shard

    def _shard_axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The (SHARDS, REPLICAS) vmap axes: the vocabulary's data axes and the other data
        axes (HSDP's replicas), or all data axes and none when it is not split."""
        inner = self.rules.vocab_data_axes
        if not inner:
            return self.data_axes, ()
        return inner, tuple(a for a in self.data_axes if a not in inner and self.mesh.shape[a] > 1)

    def _shard_index(self) -> jax.Array:
        """The data-shard index, batched over every vmap over data shards."""
        index = lax.axis_index(SHARDS)
        return index + lax.axis_index(REPLICAS) if self._shard_axes()[1] else index

    def _kept_dim(self, axes: LogicalAxes) -> int | None:
        """The dim of a stored weight whose data-parallel split is kept in compute (the
        vocabulary's), or None."""
        compute = self.rules.compute_spec("a weight", axes)
        data = set(self.data_axes)
        return next(
            (
                d
                for d, entry in enumerate(compute)
                if entry and mesh_axes_of(PartitionSpec(entry)) & data
            ),
            None,
        )

    def _per_shard_dims(self) -> Any:
        """vmap in_axes of the params: the kept dim of each kept-split weight (after
        `_split_kept`), else None."""
        if self.param_axes is None:
            return None
        return jax.tree.map(self._kept_dim, self.param_axes, is_leaf=lambda x: isinstance(x, tuple))

    def _split_kept(self, params: Params, n: int) -> Params:
        """Each kept-split weight with its kept dim split into (n shards, the rest): the
        shards' slices, for the vmap to hand one to each shard (a reshape along the storage
        split: no data moves)."""
        if self.param_axes is None:
            return params

        def split(x: jax.Array, axes: LogicalAxes) -> jax.Array:
            dim = self._kept_dim(axes)
            if dim is None:
                return x
            return x.reshape(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1 :])

        return jax.tree.map(split, params, self.param_axes)
