"""Device mesh from `[parallelism]`: axes (dp_replicate, fsdp, tp), checked against devices."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from titan_jax.config import ConfigError, Parallelism

MESH_AXES = ("dp_replicate", "fsdp", "ep", "tp")


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
    """Sizes of the mesh axes. The data-parallel shard degree (TorchTitan's dp_shard) is
    fsdp x ep: expert parallelism is carved out of it, as in TorchTitan."""

    dp_replicate: int
    fsdp: int
    tp: int
    ep: int = 1

    @property
    def dp_shard(self) -> int:
        return self.fsdp * self.ep

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def mode(self) -> str:
        """SimpleFSDP's data-parallel mode for these degrees."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return "hybrid_shard"
        if self.dp_replicate > 1:
            return "replicate"
        return "fully_shard"


def resolve_degrees(p: Parallelism, n_devices: int) -> MeshDegrees:
    """Fills data_parallel_shard_degree=-1, carves the ep axis out of it, and checks the
    product equals the device count."""
    fixed = p.data_parallel_replicate_degree * p.tensor_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if n_devices % fixed:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree x tensor_parallel_degree = {fixed} "
                f"does not divide {n_devices} devices"
            )
        shard = n_devices // fixed
    ep = p.expert_parallel_degree
    if shard % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={ep} must divide the data-parallel shard degree "
            f"{shard} (experts are split over part of the FSDP ranks, as in TorchTitan)")
    degrees = MeshDegrees(p.data_parallel_replicate_degree, shard // ep,
                          p.tensor_parallel_degree, ep)
    product = degrees.dp_replicate * degrees.dp_shard * degrees.tp
    if product != n_devices:
        raise ConfigError(
            f"parallelism degrees dp_replicate={degrees.dp_replicate} x fsdp={degrees.dp_shard} x "
            f"tp={degrees.tp} = {product} but there are {n_devices} devices; the product must "
            "equal the device count (set data_parallel_shard_degree = -1 to fill)"
        )
    return degrees


def build_mesh(degrees: MeshDegrees, devices: list[jax.Device] | None = None) -> Mesh:
    """A mesh over all (global) devices; tp innermost so its collectives stay on fast links,
    ep next (its all-to-alls are the next most frequent)."""
    devices = jax.devices() if devices is None else devices
    shape = (degrees.dp_replicate, degrees.fsdp, degrees.ep, degrees.tp)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        device_array = jax.make_mesh(shape, MESH_AXES, devices=devices,
                                     axis_types=axis_types).devices
    except (ValueError, NotImplementedError):
        device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=axis_types)
