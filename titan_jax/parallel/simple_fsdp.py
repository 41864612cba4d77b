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
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from titan_jax.models.sharding_hooks import GATHERED_PARAM, LogicalAxes, ShardingHooks
from titan_jax.models.spec import Aux, Params
from titan_jax.parallel.context_parallel import CP, ContextParallel
from titan_jax.parallel.expert_parallel import all_to_all_dispatch
from titan_jax.parallel.per_shard import jit_per_shard, manual_per_shard
from titan_jax.parallel.rules import ShardingRules

# vmap axis name of the data shards in the jit path.
SHARDS = "data_shards"

Implementation = Literal["jit", "shard_map"]
# A batch's summed loss and its aux, (params, buffers, inputs_BT, labels_BT) -> (scalar, aux),
# and a transform of it (how parallelism splits the batch's computation).
SummedLoss = Callable[[Params, Params, jax.Array, jax.Array], tuple[jax.Array, Aux]]
LossMap = Callable[[SummedLoss], SummedLoss]


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
    x = lax.with_sharding_constraint(stored.astype(dtype), storage)
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
    x = shard.astype(dtype)
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
class WeightLayout:
    """How one weight is stored and used, derived once from the rules table."""

    storage: PartitionSpec
    compute: PartitionSpec
    gathered_dims: tuple[tuple[int, str], ...]  # (dim, data axis) a use gathers
    replicated: tuple[str, ...]  # data axes it is stored whole on (its gradient sums over them)
    ndim: int

    def per_layer(self) -> WeightLayout:
        """The layout of one slice along the leading (scanned, never split) layers axis."""
        drop = lambda spec: PartitionSpec(*tuple(spec)[1:])  # noqa: E731
        return WeightLayout(drop(self.storage), drop(self.compute),
                            tuple((d - 1, a) for d, a in self.gathered_dims), self.replicated,
                            self.ndim - 1)


def weight_layouts(rules: ShardingRules, abstract: Any, logical_axes: Any
                   ) -> dict[str, WeightLayout]:
    """{dotted path: layout} of every array in `abstract` (same tree as `logical_axes`)."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    axes = jax.tree.leaves(logical_axes, is_leaf=lambda x: isinstance(x, tuple))
    layouts = {}
    for (path, x), ax in zip(leaves, axes, strict=True):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        storage = rules.storage_spec(name, ax, x.shape)
        split = {a for entry in storage for a in (entry if isinstance(entry, tuple) else (entry,))}
        replicated = tuple(a for a in rules.data_axes if a not in split)
        layouts[name] = WeightLayout(storage, rules.compute_spec(name, ax, x.shape),
                                     rules.gathered_dims(ax), replicated, len(x.shape))
    return layouts


@dataclasses.dataclass(frozen=True)
class SimpleFSDP:
    """SimpleFSDP on one mesh: `hooks()` for the model's weight reads and activation layouts,
    and `loss_map` around the step's summed loss.

    layouts: every weight's `WeightLayout` by dotted path (`weight_layouts`), computed once;
    a weight read looks its own up by path. buffer_specs: storage PartitionSpecs of the
    buffers. reduce_dtype: dtype of gradient reductions (TorchTitan's `mixed_precision_reduce`;
    fp32 by default).
    """

    rules: ShardingRules
    layouts: dict[str, WeightLayout]
    buffer_specs: Any = dataclasses.field(default_factory=dict)
    implementation: Implementation = "jit"
    reduce_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        if self.implementation not in ("jit", "shard_map"):
            raise ValueError(f"parallelism.fsdp_implementation={self.implementation!r}; "
                             "valid: jit, shard_map")
        if self.implementation == "jit" and self.mesh.shape.get("ep", 1) > 1:
            raise ValueError("expert parallelism needs the shard_map implementation (the "
                             "partitioner does not lower the jit path's dispatch to all-to-alls)")
        if self.implementation == "jit" and self.mesh.shape.get(CP, 1) > 1:
            raise ValueError("context parallelism needs the shard_map implementation (its K/V "
                             "gathers run over the manual cp axis)")

    def layout(self, path: str, ndim: int) -> WeightLayout:
        """The layout of weight `path` as used: whole, or one layer of a stacked weight."""
        if path not in self.layouts:
            raise ValueError(f"weight {path or '(unnamed)'!r} has no layout; SimpleFSDP knows "
                             f"{', '.join(sorted(self.layouts))}")
        layout = self.layouts[path]
        return layout.per_layer() if ndim == layout.ndim - 1 else layout

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.rules.mesh

    @property
    def data_axes(self) -> tuple[str, ...]:
        return self.rules.data_axes

    @property
    def n_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    def hooks(self) -> ShardingHooks:
        ep, cp = self.mesh.shape.get("ep", 1), self.mesh.shape.get(CP, 1)
        hooks = ShardingHooks(param=self.param_use, activation=self.activation_use,
                              per_shard=self.per_shard)
        if cp > 1:
            hooks = dataclasses.replace(hooks, sequence=ContextParallel(cp))
        if ep == 1:
            return hooks
        return dataclasses.replace(hooks, experts=all_to_all_dispatch("ep", ep))

    def param_use(self, value: jax.Array, path: str, logical_axes: LogicalAxes,
                  dtype: jnp.dtype) -> jax.Array:
        """The model's weight read; runs inside `loss_map`."""
        del logical_axes  # the layout was derived from them once, at build time
        layout = self.layout(path, value.ndim)
        dtype, reduce_dtype = jnp.dtype(dtype), jnp.dtype(self.reduce_dtype)
        value = value.astype(reduce_dtype)  # its transpose widens the reduced gradient
        if self.implementation == "shard_map":
            return all_gather_param(value, dtype, reduce_dtype, layout.gathered_dims,
                                    layout.replicated)
        return gather_param(value, lax.axis_index(SHARDS), dtype, reduce_dtype,
                            NamedSharding(self.mesh, layout.storage),
                            NamedSharding(self.mesh, layout.compute))

    def activation_use(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        """Pins an activation of one data shard to its model-parallel layout from the table
        (nothing to pin without a model-parallel axis)."""
        spec = self.rules.local_compute_spec("activation", logical_axes)
        if not spec:
            return x
        if self.implementation == "shard_map":  # inside: the data axes are manual
            return lax.with_sharding_constraint(x, spec)
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def per_shard(self, kernel: Callable[..., jax.Array], args: tuple[jax.Array, ...],
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
        n = self.n_shards

        def per_shard(params: Params, buffers: Params, inputs: jax.Array, labels: jax.Array
                      ) -> tuple[jax.Array, Aux]:
            # Rows are laid out shard-major, so the split moves no data.
            split = lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:])  # noqa: E731
            per = jax.vmap(summed_loss, in_axes=(None, None, 0, 0), axis_name=SHARDS,
                           spmd_axis_name=self.data_axes)
            losses, aux = per(params, buffers, split(inputs), split(labels))
            return jnp.sum(losses), jax.tree.map(lambda a: jnp.sum(a, axis=0), aux)

        return per_shard

    def _shard_map_loss(self, summed_loss: SummedLoss) -> SummedLoss:
        # Manual over the data axes only: model-parallel splits are left to the partitioner.
        data = self.data_axes
        param_specs = nested({
            name: only_axes(layout.storage, data) for name, layout in self.layouts.items()})
        buffer_specs = jax.tree.map(lambda _: PartitionSpec(), self.buffer_specs,  # whole
                                    is_leaf=lambda s: isinstance(s, PartitionSpec))
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


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """A nested dict (the params tree's shape) from {dotted path: value}."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree
