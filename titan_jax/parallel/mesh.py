"""Device mesh from `[parallelism]`: axes (pp, dp_replicate, fsdp, cp, ep, tp), checked against
the devices and laid on their topology: ICI axes inside a slice, the pipeline axis or one
data-parallel axis over DCN."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from titan_jax.config_schema import ConfigError, Parallelism

# cp (context parallelism) sits next to the model-parallel axes: its K/V all-gather runs in
# every layer, so it wants the nearer links after tp and ep. pp (pipeline stages) is outermost:
# it sends one microbatch's activations a tick, the lightest traffic, so the farthest links.
MESH_AXES = ("pp", "dp_replicate", "fsdp", "cp", "ep", "tp")


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags_with_cpu_devices(xla_flags: str, n: int | None) -> str:
    """An XLA_FLAGS value with its simulated CPU device count set to `n` (None: removed, so
    the host's one CPU device)."""
    flags = [f for f in xla_flags.split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    return " ".join(flags if n is None else [*flags, f"{_DEVICE_COUNT_FLAG}={n}"])


def set_cpu_device_count(n: int) -> None:
    """Simulated CPU devices; must run before JAX initialises its backends (0 = leave alone)."""
    if n <= 0:
        return
    os.environ["XLA_FLAGS"] = xla_flags_with_cpu_devices(os.environ.get("XLA_FLAGS", ""), n)
    jax.config.update("jax_num_cpu_devices", n)


@dataclasses.dataclass(frozen=True)
class MeshDegrees:
    """Sizes of the mesh axes. The data-parallel shard degree (TorchTitan's dp_shard) is
    fsdp x ep: expert parallelism is carved out of it, as in TorchTitan. `cp` splits each
    sequence; weights are sharded over it too (TorchTitan: over dp_shard x cp)."""

    dp_replicate: int
    fsdp: int
    tp: int
    ep: int = 1
    cp: int = 1
    pp: int = 1  # pipeline stages (`titan_jax/models/pipeline.py`); ranks along pp share rows

    @property
    def dp_shard(self) -> int:
        return self.fsdp * self.ep

    @property
    def dp(self) -> int:
        """Ranks holding different rows of the batch (cp ranks share rows, split sequences)."""
        return self.dp_replicate * self.dp_shard

    @property
    def weight_shard(self) -> int:
        """Ranks a weight is sharded over (FSDP's dp_shard, with cp folded in)."""
        return self.dp_shard * self.cp

    @property
    def mode(self) -> str:
        """SimpleFSDP's data-parallel mode for these degrees."""
        if self.dp_replicate > 1 and self.weight_shard > 1:
            return "hybrid_shard"
        if self.dp_replicate > 1:
            return "replicate"
        return "fully_shard"


def resolve_degrees(p: Parallelism, n_devices: int) -> MeshDegrees:
    """Fills data_parallel_shard_degree=-1, carves the ep axis out of it, and checks the
    product equals the device count."""
    cp, pp = p.context_parallel_degree, p.pipeline_parallel_degree
    fixed = p.data_parallel_replicate_degree * p.tensor_parallel_degree * cp * pp
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if n_devices % fixed:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree x tensor_parallel_degree x "
                f"context_parallel_degree x pipeline_parallel_degree = {fixed} does not divide "
                f"{n_devices} devices"
            )
        shard = n_devices // fixed
    ep = p.expert_parallel_degree
    if shard % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={ep} must divide the data-parallel shard degree "
            f"{shard} (experts are split over part of the FSDP ranks, as in TorchTitan)"
        )
    degrees = MeshDegrees(
        p.data_parallel_replicate_degree, shard // ep, p.tensor_parallel_degree, ep, cp, pp
    )
    product = degrees.dp_replicate * degrees.dp_shard * degrees.tp * cp * pp
    if product != n_devices:
        raise ConfigError(
            f"parallelism degrees pp={pp} x dp_replicate={degrees.dp_replicate} x "
            f"fsdp={degrees.dp_shard} x cp={cp} x tp={degrees.tp} = {product} but there are "
            f"{n_devices} devices; the "
            "product must "
            "equal the device count (set data_parallel_shard_degree = -1 to fill)"
        )
    return degrees


def slices_of(devices: list[jax.Device], num_slices: int = -1) -> list[list[jax.Device]]:
    """The devices grouped by slice. TPU multislice devices carry `slice_index`; elsewhere
    `num_slices` (-1 = 1) splits the list into equal contiguous blocks, which is how simulated
    CPU devices (and one slice per process) stand in for slices (CPU devices of a distributed
    job carry a `slice_index` too, 0 on every process)."""
    if devices[0].platform != "cpu" and hasattr(devices[0], "slice_index"):
        groups: dict[int, list[jax.Device]] = {}
        for d in devices:
            groups.setdefault(d.slice_index, []).append(d)
        found = [groups[k] for k in sorted(groups)]
        if num_slices not in (-1, len(found)):
            raise ConfigError(
                f"parallelism.num_slices={num_slices} but the devices form "
                f"{len(found)} slices (use -1 to follow the devices)"
            )
        return found
    n = 1 if num_slices == -1 else num_slices
    if len(devices) % n:
        raise ConfigError(f"parallelism.num_slices={n} does not divide {len(devices)} devices")
    size = len(devices) // n
    return [devices[i * size : (i + 1) * size] for i in range(n)]


def dcn_axis(degrees: MeshDegrees, num_slices: int) -> int:
    """Which mesh axis spans the slices: the pipeline axis when there is one and the slice count
    divides it (only activations, one microbatch a tick, cross the slow network), else HSDP's
    replicate axis when the slice count divides it (the once-per-step gradient all-reduce
    crosses it), else FSDP (its gathers cross it every layer). TP, EP and CP always stay inside
    a slice."""
    if degrees.pp > 1 and degrees.pp % num_slices == 0:
        return MESH_AXES.index("pp")
    if degrees.dp_replicate % num_slices == 0:
        return MESH_AXES.index("dp_replicate")
    if degrees.fsdp % num_slices == 0:
        return MESH_AXES.index("fsdp")
    raise ConfigError(
        f"{num_slices} slices must divide parallelism.data_parallel_replicate_degree="
        f"{degrees.dp_replicate} or the FSDP degree {degrees.fsdp} (or "
        f"pipeline_parallel_degree={degrees.pp}): only data or pipeline parallelism crosses "
        "slices (set data_parallel_replicate_degree or pipeline_parallel_degree to a multiple "
        "of the slice count)"
    )


def build_mesh(
    degrees: MeshDegrees, devices: list[jax.Device] | None = None, num_slices: int = -1
) -> Mesh:
    """A mesh over all (global) devices that follows the hardware: inside each slice the axes
    are laid on the physical topology (`mesh_utils.create_device_mesh`; tp innermost so its
    collectives stay on the nearest links, ep next), and with several slices the pipeline axis
    or one data-parallel axis spans them over DCN (`dcn_axis`), as MaxText's hybrid meshes do."""
    devices = jax.devices() if devices is None else devices
    shape = (degrees.pp, degrees.dp_replicate, degrees.fsdp, degrees.cp, degrees.ep, degrees.tp)
    slices = slices_of(devices, num_slices)
    axis = dcn_axis(degrees, len(slices)) if len(slices) > 1 else 0
    slice_shape = list(shape)
    slice_shape[axis] //= len(slices)
    device_array = np.concatenate([_slice_mesh(tuple(slice_shape), s) for s in slices], axis=axis)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _slice_mesh(shape: tuple[int, ...], devices: list[jax.Device]) -> np.ndarray:
    """Devices of one slice arranged in `shape` along its physical links where the platform
    describes them (TPU), in order otherwise."""
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError):
        return np.asarray(devices).reshape(shape)
