"""Meshes over several slices (parallel/mesh.py): one data-parallel axis spans the slices (DCN),
every other axis stays inside one; simulated on CPU by splitting the devices into blocks, and
on TPU multislice topologies compiled ahead of time (their devices know their slice)."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
from parallel_helpers import preset_overrides, single_device_overrides, tiny_config

from titan_jax.config import ConfigError
from titan_jax.parallel.mesh import MeshDegrees, build_mesh, resolve_degrees, slices_of


def _slice_ids(mesh_devices: np.ndarray, slices: list[list[jax.Device]]) -> np.ndarray:
    index = {d.id: i for i, s in enumerate(slices) for d in s}
    return np.vectorize(lambda d: index[d.id])(mesh_devices)


def test_hsdp_replicate_axis_spans_the_slices():
    devices = jax.devices()
    mesh = build_mesh(MeshDegrees(2, 4, 1), devices, num_slices=2)
    ids = _slice_ids(mesh.devices, slices_of(devices, 2))[0]  # (pp 1 first)
    assert (ids[0] == 0).all() and (ids[1] == 1).all()  # replicate index = slice


def test_fsdp_spans_the_slices_without_a_replicate_degree():
    devices = jax.devices()
    mesh = build_mesh(MeshDegrees(1, 4, 2), devices, num_slices=2)
    ids = _slice_ids(mesh.devices, slices_of(devices, 2))[0, 0, :, 0, 0, :]  # (fsdp, tp)
    assert (ids[:2] == 0).all() and (ids[2:] == 1).all()  # tp pairs never cross a slice


@pytest.mark.parametrize(
    "degrees, num_slices, message",
    [
        (MeshDegrees(1, 8, 1), 3, "num_slices=3 does not divide 8 devices"),
        (
            MeshDegrees(1, 2, 4),
            4,
            "4 slices must divide parallelism.data_parallel_replicate_degree",
        ),
    ],
)
def test_bad_slice_counts_are_config_errors(degrees, num_slices, message):
    with pytest.raises(ConfigError, match=message):
        build_mesh(degrees, jax.devices(), num_slices=num_slices)


def test_hsdp_over_two_slices_trains_like_one_device(run_tiny):
    reference = run_tiny(*single_device_overrides(), n_devices=1)
    losses = run_tiny(*preset_overrides("hsdp2x4"), "--parallelism.num_slices", "2")
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=0)


def test_num_slices_must_be_positive_or_auto():
    with pytest.raises(ConfigError, match="parallelism.num_slices=0 must be >= 1 or -1"):
        tiny_config("--parallelism.num_slices", "0")


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
)
def test_tpu_multislice_devices_put_replicas_on_separate_slices():
    from titan_jax.planner.topology import compile_only_devices, parse_slice

    devices = compile_only_devices(parse_slice("v5p-8", num_slices=2))
    config = tiny_config("--parallelism.data_parallel_replicate_degree", "2")
    degrees = resolve_degrees(config.parallelism, len(devices))
    mesh = build_mesh(degrees, devices)
    slice_index = np.vectorize(lambda d: d.slice_index)(mesh.devices)[0]  # (pp 1 first)
    assert (slice_index[0] == 0).all() and (slice_index[1] == 1).all()
    with pytest.raises(ConfigError, match="num_slices=3 but the devices form 2 slices"):
        build_mesh(degrees, devices, num_slices=3)
