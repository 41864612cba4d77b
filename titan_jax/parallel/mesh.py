"""Device mesh from `[parallelism]`: axes (dp_replicate, fsdp, tp), checked against devices."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from titan_jax.config import ConfigError, Parallelism

MESH_AXES = ("dp_replicate", "fsdp", "tp")
# The batch is split over both data-parallel axes; tp ranks see the same tokens.
BATCH_AXES = ("dp_replicate", "fsdp")


def set_cpu_device_count(n: int) -> None:
    """Simulated CPU devices; must run before JAX initialises its backends (0 = leave alone)."""
    if n <= 0:
        return
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])
    jax.config.update("jax_num_cpu_devices", n)


@dataclasses.dataclass(frozen=True)
class MeshDegrees:
    dp_replicate: int
    fsdp: int
    tp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.fsdp

    @property
    def mode(self) -> str:
        """SimpleFSDP's data-parallel mode for these degrees."""
        if self.dp_replicate > 1 and self.fsdp > 1:
            return "hybrid_shard"
        if self.dp_replicate > 1:
            return "replicate"
        return "fully_shard"


def resolve_degrees(p: Parallelism, n_devices: int) -> MeshDegrees:
    """Fills data_parallel_shard_degree=-1 and checks the product equals the device count."""
    fixed = p.data_parallel_replicate_degree * p.tensor_parallel_degree
    fsdp = p.data_parallel_shard_degree
    if fsdp == -1:
        if n_devices % fixed:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree x tensor_parallel_degree = {fixed} "
                f"does not divide {n_devices} devices"
            )
        fsdp = n_devices // fixed
    degrees = MeshDegrees(p.data_parallel_replicate_degree, fsdp, p.tensor_parallel_degree)
    product = degrees.dp_replicate * degrees.fsdp * degrees.tp
    if product != n_devices:
        raise ConfigError(
            f"parallelism degrees dp_replicate={degrees.dp_replicate} x fsdp={degrees.fsdp} x "
            f"tp={degrees.tp} = {product} but there are {n_devices} devices; the product must "
            "equal the device count (set data_parallel_shard_degree = -1 to fill)"
        )
    return degrees


def build_mesh(degrees: MeshDegrees, devices: list[jax.Device] | None = None) -> Mesh:
    """A mesh over all (global) devices; tp innermost so its collectives stay on fast links."""
    devices = jax.devices() if devices is None else devices
    shape = (degrees.dp_replicate, degrees.fsdp, degrees.tp)
    try:
        device_array = jax.make_mesh(shape, MESH_AXES, devices=devices,
                                     axis_types=(AxisType.Auto,) * 3).devices
    except (ValueError, NotImplementedError):
        device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
