"""The collectives of a compiled step as both reports read them (planner/collectives.py): the
mesh axes each spans, its network, whether it runs in the layer loop, the bytes a ring moves."""

from __future__ import annotations

from test_hlo_stats import LOOPS

from titan_jax.planner import collectives


def test_the_mesh_axes_a_collective_spans_come_from_its_device_groups():
    mesh = {"fsdp": 2, "tp": 2}  # device i sits at (i // 2, i % 2)
    assert collectives.spanned_mesh_axes([[0, 1], [2, 3]], mesh) == "tp"
    assert collectives.spanned_mesh_axes([[0, 2], [1, 3]], mesh) == "fsdp"
    assert collectives.spanned_mesh_axes([[0, 1, 2, 3]], mesh) == "fsdp+tp"
    assert collectives.spanned_mesh_axes([[0], [1]], mesh) == "-"


def test_each_collective_carries_its_axes_loop_placement_and_ring_bytes():
    ops = {c["op"]: c for c in collectives.collectives(LOOPS, mesh_shape={"a": 2, "b": 4})}
    gather, reduce = ops["all-gather"], ops["all-reduce"]
    # the gather of bf16[64,16] over groups of 4, run 12 times a step inside the inner loop
    assert (gather["axes"], gather["network"], gather["in_layer_loop"]) == ("b", "ici", True)
    assert gather["moved_bytes_per_step"] == 12 * (64 * 16 * 2) * 3 // 4
    # the all-reduce of f32[8,16] over pairs (0, 4), ...: once, across the mesh's first axis
    assert (reduce["axes"], reduce["in_layer_loop"]) == ("a", False)
    assert reduce["moved_bytes_per_step"] == 2 * (8 * 16 * 4) * 1 // 2
