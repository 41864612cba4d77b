"""TPU slices by their Cloud names and the chips' published constants (planner/topology.py)."""

from __future__ import annotations

import pytest

from titan_jax.planner import topology
from titan_jax.planner.topology import CHIPS, Chip, TopologyError, parse_slice


def test_slice_names_follow_cloud():
    assert topology.parse_slice("v5p-8").chips == 4  # v5p counts TensorCores
    assert topology.parse_slice("v5p-128").libtpu_name == "v5p:4x4x4"
    assert topology.parse_slice("v6e-8").libtpu_name == "v6e:2x4"
    assert topology.parse_slice("v5e-256").chips == 256
    assert topology.parse_slice("v4-16").libtpu_name == "v4:2x2x2"
    ironwood = topology.parse_slice("tpu7x-128")  # TensorCores: 64 chips, one 4x4x4 cube
    assert (ironwood.chips, ironwood.libtpu_name) == (64, "tpu7x:4x4x4")
    assert ironwood.wrapped_lengths == (4, 4, 4)
    assert len(topology.compile_only_devices(topology.parse_slice("tpu7x-8"))) == 8


def test_an_unknown_slice_lists_the_valid_names():
    with pytest.raises(TopologyError) as error:
        parse_slice("v5p-6")  # v5p counts TensorCores, two a chip: no 3-chip slice
    assert "'v5p-6'" in str(error.value) and "v5p-8" in str(error.value)
    assert {"v5p-8", "v6e-8", "v5e-1", "tpu7x-8", "v4-8"} <= set(topology.valid_names())
    with pytest.raises(TopologyError, match="num-slices=0"):
        parse_slice("v5p-8", num_slices=0)


def test_which_rings_close_over_wraparound_links():
    cube = parse_slice("v5p-128")  # one 4x4x4 cube: a full 3-D torus
    assert cube.wrapped_lengths == (4, 4, 4) and cube.ring_wraps((4, 16))
    small = parse_slice("v5p-8")  # 2x2x1: no wraparound links
    assert small.wrapped_lengths == () and not small.ring_wraps((2,)) and small.ring_wraps((1,))
    pod = parse_slice("v6e-256")  # 16x16: both dims span the pod's 16
    assert pod.wrapped_lengths == (16, 16) and pod.ring_wraps((16, 256))
    assert not parse_slice("v6e-8").ring_wraps((8,))


def test_ring_bandwidth_counts_the_links_a_ring_uses():
    chip = Chip("test", 1e12, 2**30, 1e9, 6e9, 1e9, 1, "test", ici_ports=6)  # 1 GB/s a link
    assert chip.ring_bytes_per_s(1) == 1e9
    assert chip.ring_bytes_per_s(2) == 2e9
    assert chip.ring_bytes_per_s(5) == 3e9  # a 3-D torus has three dimensions to ring over
    assert chip.ring_bytes_per_s(1, wraparound=False) == 0.5e9  # an open line: one way


def test_low_precision_matmuls_run_at_the_chips_published_rate_for_them():
    assert CHIPS["v6e"].mxu_time_factors == {"s8": 0.5}  # int8 at twice bf16's peak
    assert set(CHIPS["tpu7x"].mxu_time_factors) == {"f8e4m3fn", "f8e5m2"}
    assert all(0 < f < 1 for f in CHIPS["tpu7x"].mxu_time_factors.values())
    assert Chip("test", 1e12, 2**30, 1e9, 1e9, 1e9, 1, "test").mxu_time_factors == {}
