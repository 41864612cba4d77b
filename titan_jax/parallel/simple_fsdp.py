"""SimpleFSDP on a JAX mesh: weights stored sharded, gathered at use, grads reduced in fp32.

TorchTitan's SimpleFSDP (`ReplicateComputation`): every parameter lives sharded over the
data-parallel mesh axes; at each use it is cast to the param dtype and all-gathered inside the
traced step, so the compiler can schedule the collectives; its gradient is cast to the reduce
dtype (fp32) and reduce-scattered (FSDP), all-reduced (DDP) or both (HSDP). The three modes need
no separate code: the rules table shards weights over `fsdp` (size 1 under pure DDP) and never
over `dp_replicate`, so gathering to "storage spec minus the data axes" is the right collective
for each. Tensor-parallel dims (`tp`) stay split in compute.

Two implementations share the one rules table and plug into the step the same way (a
`param_use` for the model's weight reads, a `loss_map` around the summed loss):
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
"cast to reduce dtype, then reduce" exactly. (jax 0.10.2's `reduced`/`unreduced` sharding types
would say "reduce later" directly, but they need Explicit axes and have no rule yet for `take`
or for elementwise ops between a reduced weight and batch-sharded data.)

reshard_after_forward is a remat policy on the layer scan (models/qwen3/model.py RematPolicy):
the gathered weight is recomputed in backward, i.e. re-gathered.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from titan_jax.models.qwen3.build import Params
from titan_jax.parallel.mesh import BATCH_AXES
from titan_jax.parallel.rules import RULES, LogicalAxes, logical_to_spec, without_axes
from titan_jax.train.step import SummedLoss

# Mesh axes a weight is replicated over in compute; its gradient is reduced over them.
DATA_AXES = BATCH_AXES
# TorchTitan's `mixed_precision_reduce`; also the dtype of the stored master weights.
REDUCE_DTYPE = jnp.float32
# vmap axis name of the data shards in the jit path.
SHARDS = "data_shards"

Implementation = Literal["jit", "shard_map"]


def compute_spec(storage: PartitionSpec) -> PartitionSpec:
    """The spec a weight is used in: its storage spec with the data-parallel axes gathered."""
    return without_axes(storage, DATA_AXES)


# ---------------------------------------------------------------------------------------------
# The compiler path.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather_param(stored: jax.Array, shard_index: jax.Array, dtype: jnp.dtype,
                 storage: NamedSharding, compute: NamedSharding) -> jax.Array:
    """Inside the vmap over data shards: `stored` cast to `dtype`, all-gathered from `storage`
    to `compute` sharding, as this shard's own copy (`shard_index` is the batched
    `lax.axis_index(SHARDS)`, used only to give the weight the shard dimension)."""
    # Cast on the shard and pin it there: without the pin, propagation moves the cast after the
    # all-gather, which then moves fp32.
    x = lax.with_sharding_constraint(stored.astype(dtype), storage)
    x = x + (shard_index * 0).astype(dtype)  # data-dependent: zeros_like would be unbatched
    return lax.with_sharding_constraint(x, compute)  # + the shard dim over DATA_AXES (vmap)


def _gather_param_fwd(stored: jax.Array, shard_index: jax.Array, dtype: jnp.dtype,
                      storage: NamedSharding, compute: NamedSharding) -> tuple[jax.Array, None]:
    return gather_param(stored, shard_index, dtype, storage, compute), None


def _gather_param_bwd(dtype: jnp.dtype, storage: NamedSharding, compute: NamedSharding,
                      _: None, g: jax.Array) -> tuple[jax.Array, None]:
    # g is this shard's gradient. Cast before anything sums it: vmap then sums the shards'
    # fp32 gradients of the unbatched `stored`, which GSPMD emits as the fp32 reduction.
    return g.astype(REDUCE_DTYPE), None


gather_param.defvjp(_gather_param_fwd, _gather_param_bwd)


# ---------------------------------------------------------------------------------------------
# The explicit twin.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_gather_param(shard: jax.Array, dtype: jnp.dtype,
                     gathered_dims: tuple[tuple[int, str], ...]) -> jax.Array:
    """Inside shard_map: this device's `shard` cast to `dtype`, marked varying over every data
    axis and all-gathered along `gathered_dims` ((dim, mesh axis) pairs).

    Marking it varying here, not at the consumer, keeps that mark's implicit transpose (a psum
    in the cotangent's dtype, bf16) out of the backward, which reduces explicitly in fp32.
    """
    x = shard.astype(dtype)
    invariant = _unsplit_data_axes(gathered_dims)  # a shard varies over the axes it is split on
    if invariant:
        x = lax.pcast(x, invariant, to="varying")
    for dim, axis in gathered_dims:
        x = lax.all_gather(x, axis, axis=dim, tiled=True)
    return x


def _unsplit_data_axes(gathered_dims: tuple[tuple[int, str], ...]) -> tuple[str, ...]:
    split = {axis for _, axis in gathered_dims}
    return tuple(a for a in DATA_AXES if a not in split)


def _all_gather_param_fwd(shard: jax.Array, dtype: jnp.dtype,
                          gathered_dims: tuple[tuple[int, str], ...]) -> tuple[jax.Array, None]:
    return all_gather_param(shard, dtype, gathered_dims), None


def _all_gather_param_bwd(dtype: jnp.dtype, gathered_dims: tuple[tuple[int, str], ...],
                          _: None, g: jax.Array) -> tuple[jax.Array]:
    g = g.astype(REDUCE_DTYPE)  # before any reduction
    for dim, axis in reversed(gathered_dims):
        g = lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)  # FSDP
    replicated = _unsplit_data_axes(gathered_dims)
    return (lax.psum(g, replicated) if replicated else g,)  # DDP, and HSDP's replicas


all_gather_param.defvjp(_all_gather_param_fwd, _all_gather_param_bwd)


# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SimpleFSDP:
    """SimpleFSDP on one mesh, for `train_step(..., param_use=fsdp.param_use,
    loss_map=fsdp.loss_map)`.

    param_specs: the storage PartitionSpec of every parameter (same tree as the params), from
    the rules table.
    """

    mesh: Mesh
    param_specs: Any
    implementation: Implementation = "jit"

    def __post_init__(self) -> None:
        if self.implementation not in ("jit", "shard_map"):
            raise ValueError(f"parallelism.fsdp_implementation={self.implementation!r}; "
                             "valid: jit, shard_map")

    @property
    def n_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in DATA_AXES)

    def param_use(self, value: jax.Array, logical_axes: LogicalAxes,
                  dtype: jnp.dtype) -> jax.Array:
        """The model's `ParamUse` hook (models/qwen3/param_use.py); runs inside `loss_map`."""
        if self.implementation == "shard_map":
            return all_gather_param(value, jnp.dtype(dtype), self._gathered_dims(logical_axes))
        storage = logical_to_spec("parameter", logical_axes, value.shape, self.mesh)
        return gather_param(value, lax.axis_index(SHARDS), jnp.dtype(dtype),
                            NamedSharding(self.mesh, storage),
                            NamedSharding(self.mesh, compute_spec(storage)))

    def _gathered_dims(self, logical_axes: LogicalAxes) -> tuple[tuple[int, str], ...]:
        """(dim, data axis) of each dim stored split over a data axis (the same rules table)."""
        dims = []
        for dim, axis in enumerate(logical_axes):
            mesh_axis = RULES.get(axis) if axis is not None else None
            if mesh_axis in DATA_AXES and self.mesh.shape[mesh_axis] > 1:
                dims.append((dim, mesh_axis))
        return tuple(dims)

    def loss_map(self, summed_loss: SummedLoss) -> SummedLoss:
        """The step's summed loss, computed per data shard and summed over the shards."""
        if self.implementation == "shard_map":
            return self._shard_map_loss(summed_loss)
        n = self.n_shards

        def per_shard(params: Params, inputs: jax.Array, labels: jax.Array) -> jax.Array:
            # Rows are laid out shard-major, so the split moves no data.
            split = lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:])  # noqa: E731
            losses = jax.vmap(summed_loss, in_axes=(None, 0, 0), axis_name=SHARDS,
                              spmd_axis_name=DATA_AXES)(params, split(inputs), split(labels))
            return jnp.sum(losses)

        return per_shard

    def _shard_map_loss(self, summed_loss: SummedLoss) -> SummedLoss:
        # Manual over the data axes only: a tp split is left to the partitioner.
        param_specs = jax.tree.map(lambda s: without_axes(s, ("tp",)), self.param_specs)
        rows = PartitionSpec(DATA_AXES)

        def local(params: Params, inputs: jax.Array, labels: jax.Array) -> jax.Array:
            return lax.psum(summed_loss(params, inputs, labels), DATA_AXES)

        def mapped(params: Params, inputs: jax.Array, labels: jax.Array) -> jax.Array:
            return jax.shard_map(local, mesh=self.mesh, in_specs=(param_specs, rows, rows),
                                 out_specs=PartitionSpec(), axis_names=frozenset(DATA_AXES)
                                 )(params, inputs, labels)

        return mapped
