"""SimpleFSDP on a JAX mesh: weights stored sharded, gathered at use, grads reduced in fp32.

TorchTitan's SimpleFSDP (`ReplicateComputation`): every parameter lives sharded over the
data-parallel mesh axes; at each use it is cast to the param dtype and all-gathered inside the
traced step, so the compiler can schedule the collectives; its gradient is cast to the reduce
dtype (fp32) and reduce-scattered (FSDP), all-reduced (DDP) or both (HSDP). The three modes need
no separate code: the rules table shards weights over `fsdp` (size 1 under pure DDP) and never
over `dp_replicate`, so gathering to "storage spec minus the data axes" is the right collective
for each. Tensor-parallel dims (`tp`) stay split in compute.

Two implementations share the one rules table and plug into the step the same way (the
`Parallelism` hooks of `titan_jax/models/sharding_hooks.py`: `use_param` for the model's weight
reads, `loss_map` around the summed loss):
- "jit" (the compiler path): sharding constraints; GSPMD places and schedules the collectives.
- "shard_map" (the explicit twin): `jax.shard_map` over the data axes with `lax.all_gather`,
  `lax.psum_scatter` and `lax.psum` written out. It exists to prove the compiler path right.

Why the jit path maps the loss over data shards. Under plain GSPMD a weight's gradient is one
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

`mixed_precision_reduce = "bfloat16"` (TorchTitan allows it) reduces in bf16 instead: the
stored fp32 weight is first cast to the reduce dtype, whose transpose widens the reduced
gradient back to fp32, so master weights and their update stay fp32.

reshard_after_forward is a remat policy on the layer scan (`titan_jax/models/remat.py`): the
gathered weight, found by its checkpoint name, is recomputed in backward, i.e. re-gathered.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from titan_jax.models.sharding_hooks import (
    GATHERED_PARAM,
    ExpertFFN,
    Kernel,
    LogicalAxes,
    Parallelism,
    SequenceSplit,
    SummedLoss,
    VocabSplit,
)
from titan_jax.models.spec import Aux, Params
from titan_jax.parallel.context_parallel import CP, ContextParallel
from titan_jax.parallel.expert_parallel import exchange_for, ragged_dispatch
from titan_jax.parallel.per_shard import jit_per_shard, manual_per_shard
from titan_jax.parallel.rules import ShardingRules, mesh_axes_of
from titan_jax.parallel.vocab_parallel import VocabParallel

# vmap axis names of the data shards in the jit path: SHARDS over the axes the vocabulary is
# split over (all data axes when it is not split), REPLICAS over the other data axes.
SHARDS, REPLICAS = "data_shards", "data_replicas"

Implementation = Literal["jit", "shard_map"]


def only_axes(spec: PartitionSpec, keep: tuple[str, ...]) -> PartitionSpec:
    """`spec` restricted to the mesh axes in `keep` (replicated over the others)."""
    out = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n in keep)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def cast_in_loop(stored: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`stored` (one layer's slice of a scanned weight) cast to `dtype` where it is used.

    A plain convert of the slice XLA:TPU moves above the layer loop's dynamic-slice and hoists
    out of the loop: a bf16 copy of every layer's weight shard, live through forward and
    backward (3.5 GB per chip for 8B on v5p-8, docs/TPU.md). Adding zeros computed from the
    slice itself, elementwise (a float `x * 0` is not folded: it is NaN for x = inf), ties the
    cast to the iteration; it fuses into the cast, which reads the fp32 slice anyway.
    """
    if stored.dtype == dtype:
        return stored
    return (stored + lax.stop_gradient(stored) * 0).astype(dtype)


# ---------------------------------------------------------------------------------------------
# The compiler path.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def gather_param(stored: jax.Array, shard_index: jax.Array, dtype: jnp.dtype,
                 reduce_dtype: jnp.dtype, storage: NamedSharding, compute: NamedSharding
                 ) -> jax.Array:
    """Inside the vmap over data shards: `stored` cast to `dtype`, all-gathered from `storage`
    to `compute` sharding, as this shard's own copy (`shard_index` is the batched
    `lax.axis_index(SHARDS)`, used only to give the weight the shard dimension)."""
    # Cast on the shard and pin it there: without the pin, propagation moves the cast after the
    # all-gather, which then moves fp32.
    x = lax.with_sharding_constraint(cast_in_loop(stored, dtype), storage)
    x = x + (shard_index * 0).astype(dtype)  # data-dependent: zeros_like would be unbatched
    x = lax.with_sharding_constraint(x, compute)  # + the shard dim over the data axes (vmap)
    return checkpoint_name(x, GATHERED_PARAM)


def _gather_param_fwd(stored: jax.Array, shard_index: jax.Array, dtype: jnp.dtype,
                      reduce_dtype: jnp.dtype, storage: NamedSharding, compute: NamedSharding
                      ) -> tuple[jax.Array, None]:
    return gather_param(stored, shard_index, dtype, reduce_dtype, storage, compute), None


def _gather_param_bwd(dtype: jnp.dtype, reduce_dtype: jnp.dtype, storage: NamedSharding,
                      compute: NamedSharding, _: None, g: jax.Array) -> tuple[jax.Array, None]:
    # g is this shard's gradient. Cast before anything sums it: vmap then sums the shards'
    # gradients of the unbatched `stored` (already in `reduce_dtype`), which GSPMD emits as
    # the reduction.
    return g.astype(reduce_dtype), None


gather_param.defvjp(_gather_param_fwd, _gather_param_bwd)


# ---------------------------------------------------------------------------------------------
# The explicit twin.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def all_gather_param(shard: jax.Array, dtype: jnp.dtype, reduce_dtype: jnp.dtype,
                     gathered_dims: tuple[tuple[int, str], ...], replicated: tuple[str, ...]
                     ) -> jax.Array:
    """Inside shard_map: this device's `shard` cast to `dtype`, marked varying over the data
    axes it is stored whole on (`replicated`) and all-gathered along `gathered_dims` ((dim,
    mesh axis) pairs). Splits a use keeps (experts over `ep`) stay local.

    Marking it varying here, not at the consumer, keeps that mark's implicit transpose (a psum
    in the cotangent's dtype, bf16) out of the backward, which reduces explicitly.
    """
    x = cast_in_loop(shard, dtype)
    if replicated:
        x = lax.pcast(x, replicated, to="varying")
    for dim, axis in gathered_dims:
        x = lax.all_gather(x, axis, axis=dim, tiled=True)
    return checkpoint_name(x, GATHERED_PARAM)


def _all_gather_param_fwd(shard: jax.Array, dtype: jnp.dtype, reduce_dtype: jnp.dtype,
                          gathered_dims: tuple[tuple[int, str], ...],
                          replicated: tuple[str, ...]) -> tuple[jax.Array, None]:
    return all_gather_param(shard, dtype, reduce_dtype, gathered_dims, replicated), None


def _all_gather_param_bwd(dtype: jnp.dtype, reduce_dtype: jnp.dtype,
                          gathered_dims: tuple[tuple[int, str], ...], replicated: tuple[str, ...],
                          _: None, g: jax.Array) -> tuple[jax.Array]:
    g = g.astype(reduce_dtype)  # before any reduction
    for dim, axis in reversed(gathered_dims):
        g = lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)  # FSDP
    return (lax.psum(g, replicated) if replicated else g,)  # DDP, and HSDP's replicas


all_gather_param.defvjp(_all_gather_param_fwd, _all_gather_param_bwd)


# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SimpleFSDP(Parallelism):
    """SimpleFSDP on one mesh: the model's hooks (weight reads, activation layouts, the expert
    dispatch, per-shard kernels) and the `loss_map` around the step's summed loss.

    A weight's layout comes from its logical axes as used (`ShardingRules.weight_layout`).
    param_specs, buffer_specs: storage PartitionSpecs of the params and buffers (trees), the
    in_specs of the shard_map twin. reduce_dtype: dtype of gradient reductions (TorchTitan's
    `mixed_precision_reduce`; fp32 by default). param_axes: the params' logical axes (tree),
    which the jit path needs to hand each shard its own slice of the vocabulary tables.
    """

    rules: ShardingRules
    param_specs: Any
    buffer_specs: Any = dataclasses.field(default_factory=dict)
    implementation: Implementation = "jit"
    reduce_dtype: Any = jnp.float32
    cp_method: str = "allgather"  # parallelism.context_parallel_method
    param_axes: Any = None

    def __post_init__(self) -> None:
        if self.implementation not in ("jit", "shard_map"):
            raise ValueError(f"parallelism.fsdp_implementation={self.implementation!r}; "
                             "valid: jit, shard_map")
        if self.implementation == "jit" and self.ep > 1:
            raise ValueError("expert parallelism needs the shard_map implementation (the "
                             "partitioner does not lower the jit path's dispatch to all-to-alls)")
        if self.implementation == "jit" and self.mesh.shape.get(CP, 1) > 1:
            raise ValueError("context parallelism needs the shard_map implementation (its K/V "
                             "gathers run over the manual cp axis)")

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.rules.mesh

    @property
    def data_axes(self) -> tuple[str, ...]:
        return self.rules.data_axes

    @property
    def n_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def ep(self) -> int:
        return self.mesh.shape.get("ep", 1)

    @property
    def cp(self) -> int:
        return self.mesh.shape.get(CP, 1)

    def use_param(self, value: jax.Array, logical_axes: LogicalAxes, dtype: jnp.dtype
                  ) -> jax.Array:
        """Cast to `dtype` and gathered from storage to compute layout; runs inside
        `loss_map`."""
        layout = self.rules.weight_layout(logical_axes)
        dtype, reduce_dtype = jnp.dtype(dtype), jnp.dtype(self.reduce_dtype)
        value = value.astype(reduce_dtype)  # its transpose widens the reduced gradient
        kept = bool(mesh_axes_of(layout.compute) & set(self.data_axes))
        if kept and "vocab" in logical_axes:
            # The vocabulary tables, kept split over the data shards: handed over as stored,
            # in the reduce dtype, without a compute-dtype copy; their users cast it chunk by
            # chunk and sum its gradient over chunks in that dtype (vocab_parallel.py). The
            # experts, kept split over ep, are cast like any weight: in the reduce dtype their
            # grouped matmuls, and the rows the exchange returns, would be fp32.
            dtype = reduce_dtype
        if self.implementation == "shard_map":
            return all_gather_param(value, dtype, reduce_dtype, layout.gathered_dims,
                                    layout.replicated)
        if kept:  # `loss_map` hands in this shard's slice, used as it is
            return self.constrain(value.astype(dtype), logical_axes)
        return gather_param(value, self._shard_index(), dtype, reduce_dtype,
                            NamedSharding(self.mesh, layout.storage),
                            NamedSharding(self.mesh, layout.compute))

    def constrain(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        """Pins an activation of one data shard to its model-parallel layout from the table
        (nothing to pin without a model-parallel axis)."""
        spec = self.rules.local_compute_spec("activation", logical_axes)
        if not spec:
            return x
        if self.implementation == "shard_map":  # inside: the data axes are manual
            return lax.with_sharding_constraint(x, spec)
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def dispatch_to_experts(self, rows_MD: jax.Array, experts_M: jax.Array, n_local: int,
                            ffn: ExpertFFN) -> jax.Array:
        """Under expert parallelism the picks travel to their expert's rank and back by the
        target devices' ragged all-to-all (`parallel/expert_parallel.py`: emulated on CPU);
        otherwise every expert is local."""
        if self.ep == 1:
            return super().dispatch_to_experts(rows_MD, experts_M, n_local, ffn)
        exchange = exchange_for(self.mesh.devices.flat[0].platform, rows_MD.shape[0])
        return ragged_dispatch(rows_MD, experts_M, n_local, ffn, "ep", self.ep, exchange)

    def vocab_split(self) -> VocabSplit:
        """The vocabulary tables' split over the data axes (`parallel/vocab_parallel.py`):
        named by the jit path's vmap axis, or the shard_map twin's manual mesh axes."""
        axes = self.rules.vocab_data_axes
        if not axes:
            return super().vocab_split()
        degree = math.prod(self.mesh.shape[a] for a in axes)
        return VocabParallel(SHARDS if self.implementation == "jit" else axes, degree)

    def sequence_split(self) -> SequenceSplit:
        """Under context parallelism each rank holds two chunks of every sequence and gathers
        K/V over `cp` or passes them around it (`parallel/context_parallel.py`)."""
        if self.cp == 1:
            return super().sequence_split()
        return ContextParallel(self.cp, self.cp_method)

    def run_per_shard(self, kernel: Kernel, args: tuple[jax.Array, ...],
                      in_axes: tuple[LogicalAxes, ...], out_axes: LogicalAxes) -> jax.Array:
        """A kernel GSPMD cannot partition (Pallas), run on each device's own rows and heads
        under shard_map (`parallel/per_shard.py`); the specs are the table's model-parallel
        part of the activations' layout (the data axes are the per-shard map's). Runs inside
        `loss_map`."""
        local = lambda axes: self.rules.local_compute_spec("activation", axes)  # noqa: E731
        in_specs, out_spec = tuple(local(axes) for axes in in_axes), local(out_axes)
        if self.implementation == "shard_map":
            return manual_per_shard(kernel, args, in_specs, out_spec, self.data_axes)
        return jit_per_shard(self.mesh, kernel, args, in_specs, out_spec)

    def loss_map(self, summed_loss: SummedLoss) -> SummedLoss:
        """The step's summed loss (and aux), computed per data shard and summed over shards."""
        if self.implementation == "shard_map":
            return self._shard_map_loss(summed_loss)
        inner, outer = self._shard_axes()
        n_in = math.prod(self.mesh.shape[a] for a in inner)
        n_out = self.n_shards // n_in
        per = jax.vmap(summed_loss, in_axes=(self._per_shard_dims(), None, 0, 0),
                       axis_name=SHARDS, spmd_axis_name=inner)
        if outer:
            if self.data_axes.index(outer[-1]) > self.data_axes.index(inner[0]):
                raise ValueError(f"the jit path needs the replicated data axes {outer} before "
                                 f"the vocabulary's {inner} in the batch's order")
            per = jax.vmap(per, in_axes=(None, None, 0, 0), axis_name=REPLICAS,
                           spmd_axis_name=outer)

        def per_shard(params: Params, buffers: Params, inputs: jax.Array, labels: jax.Array
                      ) -> tuple[jax.Array, Aux]:
            # Rows are laid out shard-major, so the split moves no data.
            split = lambda x: x.reshape(  # noqa: E731
                *((n_out,) if outer else ()), n_in, x.shape[0] // self.n_shards, *x.shape[1:])
            losses, aux = per(self._split_kept(params, n_in), buffers, split(inputs),
                              split(labels))
            total = lambda a: jnp.sum(a, axis=(0, 1) if outer else 0)  # noqa: E731
            return total(losses), jax.tree.map(total, aux)

        return per_shard

    def _shard_axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The jit path's (SHARDS, REPLICAS) vmap axes: the vocabulary's data axes and the
        other data axes (HSDP's replicas), or all data axes and none when it is not split."""
        inner = self.rules.vocab_data_axes
        if not inner:
            return self.data_axes, ()
        return inner, tuple(a for a in self.data_axes
                            if a not in inner and self.mesh.shape[a] > 1)

    def _shard_index(self) -> jax.Array:
        """The jit path's data-shard index, batched over every vmap over data shards."""
        index = lax.axis_index(SHARDS)
        return index + lax.axis_index(REPLICAS) if self._shard_axes()[1] else index

    def _kept_dim(self, axes: LogicalAxes) -> int | None:
        """The dim of a stored weight whose data-parallel split is kept in compute (the
        vocabulary's), or None."""
        compute = self.rules.compute_spec("a weight", axes)
        data = set(self.data_axes)
        return next((d for d, entry in enumerate(compute)
                     if entry and mesh_axes_of(PartitionSpec(entry)) & data), None)

    def _per_shard_dims(self) -> Any:
        """vmap in_axes of the params: the kept dim of each kept-split weight (after
        `_split_kept`), else None."""
        if self.param_axes is None:
            return None
        return jax.tree.map(self._kept_dim, self.param_axes,
                            is_leaf=lambda x: isinstance(x, tuple))

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
            return x.reshape(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1:])

        return jax.tree.map(split, params, self.param_axes)

    def _shard_map_loss(self, summed_loss: SummedLoss) -> SummedLoss:
        # Manual over the data axes only: model-parallel splits are left to the partitioner.
        data = self.data_axes
        is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
        param_specs = jax.tree.map(lambda s: only_axes(s, data), self.param_specs,
                                   is_leaf=is_spec)
        buffer_specs = jax.tree.map(lambda _: PartitionSpec(), self.buffer_specs,  # whole
                                    is_leaf=is_spec)
        rows = self.rules.batch_spec  # rows, and under context parallelism sequence chunks

        def local(params: Params, buffers: Params, inputs: jax.Array, labels: jax.Array
                  ) -> tuple[jax.Array, Aux]:
            return jax.tree.map(lambda x: lax.psum(x, data),
                                summed_loss(params, buffers, inputs, labels))

        def mapped(params: Params, buffers: Params, inputs: jax.Array, labels: jax.Array
                   ) -> tuple[jax.Array, Aux]:
            return jax.shard_map(local, mesh=self.mesh,
                                 in_specs=(param_specs, buffer_specs, rows, rows),
                                 out_specs=PartitionSpec(), axis_names=frozenset(data)
                                 )(params, buffers, inputs, labels)

        return mapped
