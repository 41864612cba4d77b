"""Logical axis names -> mesh axes: one table, and the shardings derived from it.

The model names each parameter dimension (embed, heads, mlp, ...); this table says which mesh
axis splits it. SimpleFSDP's modes need no separate tables: parameters are sharded over `fsdp`,
which has size 1 under pure replication (DDP), and the batch over (dp_replicate, fsdp). Tensor
parallelism is Megatron's split: attention heads and the MLP hidden dimension (and the vocab)
over `tp`.
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalAxes = tuple[str | None, ...]

RULES: Mapping[str, str | None] = {
    "layers": None,  # scanned over, never split
    "embed": "fsdp",  # the SimpleFSDP shard dimension of every weight that has it
    "norm": "fsdp",
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "head_dim": None,
}


def logical_to_spec(name: str, axes: LogicalAxes, shape: tuple[int, ...], mesh: Mesh,
                    rules: Mapping[str, str | None] = RULES) -> PartitionSpec:
    """The PartitionSpec of parameter `name`; errors on collisions and indivisible dims."""
    if len(axes) != len(shape):
        raise ValueError(f"{name}: logical axes {axes} do not match shape {shape}")
    spec: list[str | None] = []
    used: dict[str, str] = {}
    for dim, (axis, size) in enumerate(zip(axes, shape, strict=True)):
        if axis is not None and axis not in rules:
            raise ValueError(f"{name}: logical axis {axis!r} has no sharding rule")
        mesh_axis = rules.get(axis) if axis is not None else None
        if mesh_axis is not None and mesh.shape[mesh_axis] == 1:
            mesh_axis = None  # keeps specs minimal and readable
        if mesh_axis is not None:
            if mesh_axis in used:
                raise ValueError(
                    f"{name}: logical axes {used[mesh_axis]!r} and {axis!r} both map to mesh "
                    f"axis {mesh_axis!r}; one array dimension per mesh axis"
                )
            if size % mesh.shape[mesh_axis]:
                raise ValueError(
                    f"{name}: dimension {dim} ({axis}={size}) is not divisible by mesh axis "
                    f"{mesh_axis}={mesh.shape[mesh_axis]}"
                )
            used[mesh_axis] = axis
        spec.append(mesh_axis)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def without_axes(spec: PartitionSpec, drop: tuple[str, ...]) -> PartitionSpec:
    """`spec` with the given mesh axes removed (replicated over them)."""
    out = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n not in drop)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def named(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    return NamedSharding(mesh, spec)
