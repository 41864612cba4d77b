"""THE sharding table: logical axis -> mesh axes, for parameters and activations alike.

The model names every dimension it creates by a logical axis (`embed`, `heads`, `mlp`, ...;
activations also `batch` and `seq`); this table says which mesh axis, or tuple of mesh axes,
splits it. Every sharding in a run is derived here, once:

- a parameter's *storage* spec: the table as it stands (SimpleFSDP: weights live sharded over
  `fsdp` on their `embed` dimension);
- its *compute* spec, the layout the forward uses it in: the storage spec with the data-parallel
  axes (`data_axes`, the batch's) gathered, tensor-parallel splits kept;
- an activation's spec: the compute view too, so the data-parallel axes split only `batch`.
`expert` keeps its split in compute too: expert parallelism (`ep`, carved out of the FSDP
ranks as in TorchTitan) means each rank computes only the experts it holds. Context
parallelism splits `seq` over `cp`; since each cp rank sees different tokens, `cp` is one more
data-parallel axis for the weights (stored sharded over it, gathered at use, gradients reduced
over it: TorchTitan shards parameters over dp_shard x cp).

SimpleFSDP's modes need no separate tables: weights are sharded over `fsdp`, which has size 1
under pure replication (DDP), and the batch over (dp_replicate, fsdp). Tensor parallelism is
Megatron's split: attention heads, the MLP hidden dimension and the vocab over `tp`. Changing a
parallelism is an edit of this table plus the layer that uses the new axis (an expert axis:
`"expert": "ep"` and the MoE layer).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from titan_jax.models.sharding_hooks import LogicalAxes
from titan_jax.trees import leaf_name

MeshAxes = str | tuple[str, ...] | None

DEFAULT_TABLE: Mapping[str, MeshAxes] = {
    "batch": ("dp_replicate", "fsdp", "ep"),  # activations' rows: every data-parallel axis
    "seq": "cp",  # context parallelism (load-balanced chunks: parallel/context_parallel.py)
    # The stacked layers' dim: split into pipeline stages (consecutive layers per stage); the
    # pipeline's stage dim of activations is named `layers` too (titan_jax/models/pipeline.py).
    "layers": "pp",
    "embed": ("fsdp", "cp", "ep"),  # SimpleFSDP's shard dim of every weight that has it
    "norm": ("fsdp", "cp", "ep"),  # norm weights, sharded like `embed`
    # The vocabulary tables: split over the data axes and tp, and kept split in compute
    # (parallel/vocab_parallel.py: tokens travel, not the table). Order: as in `data_axes`.
    "vocab": ("fsdp", "ep", "cp", "tp"),
    "vocab_embed": None,  # the vocabulary tables' model dim (their vocab dim is split)
    "heads": "tp",  # Megatron's split: attention heads
    "kv_heads": "tp",  # and the K/V heads
    "mlp": "tp",  # and the MLP's hidden dim (the experts' too)
    "head_dim": None,  # never split
    # MoE experts: split over ep (expert parallelism), their model dim FSDP-split over the rest.
    "expert": "ep",
    "moe_embed": ("fsdp", "cp"),  # the experts' model dim (ep already splits their expert dim)
    # LoRA adapters' rank dim: small, never split (their other dim is the base weight's axis,
    # so A and B are sharded and gathered like the weight they sit beside).
    "lora_rank": None,
}
# Logical axes whose data-parallel splits survive into compute: the batch and the sequence (they
# are the data) and the experts (under expert parallelism each rank computes the experts it
# holds).
KEPT_IN_COMPUTE = ("batch", "seq", "expert", "vocab")
# A vocabulary the table's split does not divide: the tables are FSDP weights like the others
# (split on their model dim, gathered at use), the vocabulary split over tp only.
GATHERED_VOCAB: Mapping[str, MeshAxes] = {"vocab": "tp", "vocab_embed": DEFAULT_TABLE["embed"]}


def table_with_overrides(
    overrides: Mapping[str, list[str]], table: Mapping[str, MeshAxes] = DEFAULT_TABLE
) -> Mapping[str, MeshAxes]:
    """`table` with a recipe's rules (`parallelism.sharding_rules`: logical axis -> mesh axes,
    [] for none) in place of its own; a rule for an axis the table does not have is refused.
    The mesh axes are checked by `ShardingRules`, the shapes by `storage_specs`."""
    unknown = sorted(set(overrides) - set(table))
    if unknown:
        raise ShardingRuleError(
            f"parallelism.sharding_rules: {unknown[0]!r} is not a logical "
            f"axis of the sharding table; valid: {', '.join(table)}"
        )
    rules = {
        name: (axes[0] if len(axes) == 1 else tuple(axes)) if axes else None
        for name, axes in overrides.items()
    }
    return {**table, **rules}


def table_for_vocab(
    mesh: Mesh,
    vocab_size: int,
    split_across_replicas: bool = True,
    table: Mapping[str, MeshAxes] = DEFAULT_TABLE,
    travelling_tokens: int = 0,
) -> Mapping[str, MeshAxes]:
    """`table`, with the vocabulary tables gathered (GATHERED_VOCAB) when `vocab_size` does not
    divide over the mesh axes `table` splits the vocabulary over, when the mesh has HSDP
    replicas and SimpleFSDP's implementation cannot keep the split across them
    (`SimpleFSDP.splits_vocab_across_replicas`), or when the split would move more bytes than
    gathering the tables: split, a microbatch's tokens travel (`travelling_tokens`, every
    token of the shards that split the vocabulary: hidden states gathered for the loss and its
    recompute, their fp32 gradient reduce-scattered, the embedding's rows reduce-scattered and
    their gradient gathered: ~14 bytes x dim a token), where gathered, each table travels
    (gathered in bf16 for forward and again for backward, its fp32 gradient reduce-scattered:
    ~8 bytes x dim a row, two tables when untied). Qwen3-235B on 128 shards of 4096 tokens
    sends 524,288 tokens against 151,936 rows: gathered, as MaxText does."""
    split = math.prod(mesh.shape[a] for a in axes_tuple(table.get("vocab")))
    replicas = not split_across_replicas and mesh.shape.get("dp_replicate", 1) > 1
    heavier = travelling_tokens > vocab_size
    return (
        table
        if vocab_size % split == 0 and not replicas and not heavier
        else {**table, **GATHERED_VOCAB}
    )


def axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def mesh_axes_of(spec: PartitionSpec) -> set[str]:
    """Every mesh axis `spec` splits some dim over."""
    return {a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))}


class ShardingRuleError(ValueError):
    """A logical axis without a rule, two dims on one mesh axis, or an indivisible dim."""


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How a weight is stored and used, from its logical axes alone."""

    storage: PartitionSpec
    compute: PartitionSpec
    gathered_dims: tuple[tuple[int, str], ...]  # (dim, data axis) a use gathers, in order
    replicated: tuple[str, ...]  # data axes it is stored whole on (its gradient sums over them)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The table on one mesh."""

    mesh: Mesh
    table: Mapping[str, MeshAxes] = dataclasses.field(default_factory=lambda: DEFAULT_TABLE)
    _layouts: dict[LogicalAxes, WeightLayout] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name, axes in self.table.items():
            unknown = [a for a in axes_tuple(axes) if a not in self.mesh.shape]
            if unknown:
                raise ShardingRuleError(
                    f"sharding rule {name!r} -> {axes!r}: mesh has no axis "
                    f"{unknown[0]!r} (axes: {', '.join(self.mesh.shape)})"
                )

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch's rows are split over."""
        return axes_tuple(self.table.get("batch"))

    @property
    def seq_axes(self) -> tuple[str, ...]:
        """Mesh axes each sequence is split over (context parallelism)."""
        return tuple(a for a in axes_tuple(self.table.get("seq")) if a not in self.batch_axes)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh axes tokens differ across (rows, then sequence chunks): the data-parallel axes a
        weight is gathered over at use and its gradient reduced over."""
        return self.batch_axes + self.seq_axes

    @property
    def vocab_data_axes(self) -> tuple[str, ...]:
        """Data axes the vocabulary tables stay split over in compute (table order; size-1
        axes dropped): their lookup and the loss exchange tokens over these."""
        return tuple(a for a in self._mesh_axes("vocab") if a in self.data_axes)

    @property
    def batch_spec(self) -> PartitionSpec:
        """The layout of a (rows, seq) batch of tokens: rows over the batch axes, each
        sequence (in context parallelism's load-balanced order) over the seq axes."""
        seq = self.seq_axes  # size-1 axes kept: the shard_map's tokens vary over every data axis
        return PartitionSpec(self.batch_axes, (seq[0] if len(seq) == 1 else seq) or None)

    def storage_spec(self, name: str, axes: LogicalAxes, shape: tuple[int, ...]) -> PartitionSpec:
        """How parameter `name` is stored."""
        return self._spec(name, axes, shape, drop=())

    def compute_spec(
        self, name: str, axes: LogicalAxes, shape: tuple[int, ...] | None = None
    ) -> PartitionSpec:
        """How a weight is used, or an activation laid out: data-parallel axes split only the
        batch and the experts. `shape` None skips the divisibility check (activations inside
        a trace)."""
        return self._spec(name, axes, shape, drop=self.data_axes)

    def local_compute_spec(self, name: str, axes: LogicalAxes) -> PartitionSpec:
        """The compute spec with every data axis dropped, for code that already runs per data
        shard (SimpleFSDP's per-shard vmap or shard_map): only model-parallel splits remain."""
        return self._spec(name, axes, None, drop=self.data_axes, keep_data_splits=False)

    def gathered_dims(self, axes: LogicalAxes) -> tuple[tuple[int, str], ...]:
        """(dim, mesh axis) of each stored split that a use gathers, in the order to gather
        them: a dim split over several mesh axes (major to minor) gathers its minor axis
        first, so each tiled gather concatenates contiguous blocks."""
        dims = []
        for dim, axis in enumerate(axes):
            if axis in KEPT_IN_COMPUTE:
                continue
            for mesh_axis in reversed(self._mesh_axes(axis)):
                if mesh_axis in self.data_axes:
                    dims.append((dim, mesh_axis))
        return tuple(dims)

    def weight_layout(self, axes: LogicalAxes) -> WeightLayout:
        """The layout of a weight with logical axes `axes`, as it is used (inside the layer
        scan: one layer's, without `layers`), derived once per axes tuple. Shapes are checked
        by `storage_specs`, which names each parameter, when the run is set up."""
        layout = self._layouts.get(axes)
        if layout is None:
            name = f"a weight with logical axes {axes}"
            storage = self._spec(name, axes, None, drop=())
            layout = WeightLayout(
                storage,
                self._spec(name, axes, None, drop=self.data_axes),
                self.gathered_dims(axes),
                tuple(a for a in self.data_axes if a not in mesh_axes_of(storage)),
            )
            self._layouts[axes] = layout
        return layout

    def storage_specs(self, abstract: Any, logical_axes: Any) -> Any:
        """The storage PartitionSpec of every array in `abstract` (same tree as
        `logical_axes`); a ShardingRuleError names the first array the table cannot split."""

        def spec(path: tuple, x: Any, axes: LogicalAxes) -> PartitionSpec:
            return self.storage_spec(leaf_name(path), axes, x.shape)

        return jax.tree_util.tree_map_with_path(spec, abstract, logical_axes)

    def _mesh_axes(self, axis: str | None) -> tuple[str, ...]:
        """Mesh axes of logical `axis` that split it (size-1 axes dropped: minimal specs)."""
        if axis is None:
            return ()
        return tuple(a for a in axes_tuple(self.table[axis]) if self.mesh.shape[a] > 1)

    def _spec(
        self,
        name: str,
        axes: LogicalAxes,
        shape: tuple[int, ...] | None,
        drop: tuple[str, ...],
        keep_data_splits: bool = True,
    ) -> PartitionSpec:
        if shape is not None and len(axes) != len(shape):
            raise ShardingRuleError(f"{name}: logical axes {axes} do not match shape {shape}")
        spec: list[MeshAxes] = []
        used: dict[str, str | None] = {}
        for dim, axis in enumerate(axes):
            if axis is not None and axis not in self.table:
                raise ShardingRuleError(f"{name}: logical axis {axis!r} has no sharding rule")
            mesh_axes = self._mesh_axes(axis)
            if axis not in KEPT_IN_COMPUTE or not keep_data_splits:
                mesh_axes = tuple(a for a in mesh_axes if a not in drop)
            for a in mesh_axes:
                if a in used:
                    raise ShardingRuleError(
                        f"{name}: logical axes {used[a]!r} and {axis!r} both map to mesh axis "
                        f"{a!r}; one array dimension per mesh axis"
                    )
                used[a] = axis
            size = math.prod(self.mesh.shape[a] for a in mesh_axes)
            if shape is not None and shape[dim] % size:
                split = " x ".join(f"{a}={self.mesh.shape[a]}" for a in mesh_axes)
                raise ShardingRuleError(
                    f"{name}: dimension {dim} ({axis}={shape[dim]}) is not divisible by mesh "
                    f"axis {split}"
                )
            spec.append(
                None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
            )
        while spec and spec[-1] is None:
            spec.pop()
        return PartitionSpec(*spec)
