"""The collectives of a compiled step, read from its HLO text: the one reading both reports use
(`titan-jax inspect` groups them by op and dtype; `titan-jax compile` also by network, loop
placement and mesh axes, and times them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from titan_jax.planner import hlo_cost, hlo_stats


def _network(groups: list[list[int]], slice_of: list[int]) -> str:
    """`dcn` when a device group spans slices, else `ici`."""
    spans = any(len({slice_of[i] for i in g if i < len(slice_of)}) > 1 for g in groups)
    return "dcn" if spans else "ici"


def spanned_mesh_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
    """The mesh axes a collective's device groups span ("cp", "fsdp+cp", ...; "-" if none),
    from each device's coordinates in the mesh (group ids index the mesh's devices)."""
    names, shape = list(mesh_shape), tuple(mesh_shape.values())
    spanned = set()
    for group in groups:
        coords = np.array(np.unravel_index([i for i in group if i < np.prod(shape)], shape))
        spanned |= {names[a] for a in range(len(names)) if len(set(coords[a])) > 1}
    return "+".join(n for n in names if n in spanned) or "-"


def collectives(
    hlo_text: str, mesh_devices: Sequence[Any] = (), mesh_shape: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """Every collective instruction of the step (`hlo_stats.collective_ops`: op, dtype, result
    bytes per device, executions per step), with its network (ici/dcn), loop placement, the
    mesh axes it spans (given the mesh's shape) and the bytes a ring moves per step (given the
    mesh's devices; an instruction's own device groups otherwise)."""
    slice_of = [getattr(d, "slice_index", 0) for d in mesh_devices]
    ops = hlo_stats.collective_ops(hlo_stats.parse(hlo_text))
    for c in ops:
        c["axes"] = spanned_mesh_axes(c["groups"], mesh_shape) if mesh_shape else "-"
        if c.get("network") == "dcn":  # a megascale transfer: one peer per slice
            group = len(set(slice_of))
        else:
            group = c["group"] or len(mesh_devices)
            c["network"] = _network(c["groups"], slice_of)
        c["in_layer_loop"] = c["executions"] > 1
        moved = hlo_cost.moved_bytes(c["op"], c["bytes"], group)
        c["moved_bytes_per_step"] = moved * c["executions"]
    return ops
