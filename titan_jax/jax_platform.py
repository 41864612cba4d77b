"""Choose JAX's platform before JAX starts: "cpu" on hosts without an accelerator.

With libtpu installed (the `tpu` extra), every `import jax` on a machine without a TPU probes
for one and prints pages of errors (host bounds, worker hostname, a source trace). Saying
`JAX_PLATFORMS=cpu` up front silences that. The rule is the Makefile's: no TPU (`/dev/accel*`,
`/dev/vfio/*`) and no NVIDIA GPU (`/dev/nvidia0`) device node means a CPU host. A value the
user set is never overridden, and accelerator hosts are left to JAX's own choice.
"""

from __future__ import annotations

import glob
import os

ACCELERATOR_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/*", "/dev/nvidia0")


def has_accelerator_device() -> bool:
    """Whether the host exposes a TPU or GPU device node."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_GLOBS)


def default_to_cpu_without_accelerator() -> str | None:
    """Sets JAX_PLATFORMS=cpu on hosts with no accelerator unless the variable is already set.

    Call before the first `import jax`. Returns the JAX_PLATFORMS value now in effect (None:
    JAX chooses).
    """
    if "JAX_PLATFORMS" not in os.environ and not has_accelerator_device():
        os.environ["JAX_PLATFORMS"] = "cpu"
    return os.environ.get("JAX_PLATFORMS")


def is_tpu_host() -> bool:
    """Whether JAX will run on TPUs here, decided before JAX starts: JAX_PLATFORMS names tpu,
    or (unset) the host exposes a TPU device node."""
    platforms = os.environ.get("JAX_PLATFORMS")
    if platforms:
        return "tpu" in platforms.split(",")
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_GLOBS[:2])


def compile_only_libtpu() -> None:
    """For `titan-jax compile` (AOT for a named slice): JAX runs on the host CPU, so a TPU VM's
    own chips are never opened, and libtpu, loaded only to compile, skips its multi-process
    lockfile (`/tmp/libtpu_lockfile`, held by a training job on those chips: waiting for it,
    or deleting it as libtpu's message suggests, would break that job). Call before JAX starts.
    """
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    default_libtpu_flags()  # the compile plans the schedule the training job will run


# libtpu flags that make XLA:TPU schedule the layer loop's FSDP all-gathers asynchronously under
# the layer's compute (libtpu 0.0.42.1 without them made them synchronous: 0% of their time
# covered on Qwen3-8B v6e-8; docs/TPU.md). They change scheduling and where a collective runs,
# not what it computes.
# `xla_tpu_enable_async_collective_fusion_fuse_all_gather`, the third one MaxText's older recipes
# set, is refused by libtpu 0.0.50 on every chip but v5e ("Continuation fusion for AllGather ...
# not supported/recommended on platforms other than TPU v5e"): a v5p or v6e step would not
# compile with it. The third keeps an all-gather an (async) all-gather: without it XLA:TPU
# compiles some FSDP gathers as synchronous all-reduces of a zero-filled buffer, twice the bytes
# (seconds of 235B-A22B's fsdp512 step on tpu7x-512); MaxText's Ironwood recipes set it.
ASYNC_GATHER_FLAGS = (
    "--xla_enable_async_all_gather=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_tpu_prefer_async_allgather_to_allreduce=true",
)
# ... and that run them on the SparseCores (v5p, v6e, tpu7x), so each FSDP all-gather and
# gradient reduce-scatter is asynchronous beside the TensorCore's compute: with the three above
# alone libtpu 0.0.50 compiles the in-loop gathers of v5p and v6e steps synchronously (with
# them most of those gathers' time is covered: docs/notes/2026-12-05-qwen3-235b-step-time.md).
# v5e (no SparseCores) and tpu7x (offloaded by default) compile the same schedule with them.
# MaxText's recipes set them too, with
# `xla_tpu_enable_async_collective_fusion_fuse_all_gather=false`, which is left out: on v5e it
# turns off the fused continuation that overlaps its gathers there.
SPARSECORE_OFFLOAD_FLAGS = (
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_collective_aggregator=true",
)
DEFAULT_LIBTPU_FLAGS = ASYNC_GATHER_FLAGS + SPARSECORE_OFFLOAD_FLAGS


def default_libtpu_flags() -> str:
    """Adds DEFAULT_LIBTPU_FLAGS to LIBTPU_INIT_ARGS, each unless the variable already names that
    flag (a value the user set wins; `--xla_enable_async_all_gather=false` turns one off).
    Call before libtpu loads (JAX's first TPU backend or topology). Returns the value."""
    return add_libtpu_flags(DEFAULT_LIBTPU_FLAGS)


def add_libtpu_flags(flags: tuple[str, ...]) -> str:
    """Adds `flags` to LIBTPU_INIT_ARGS, each unless the variable already names that flag.
    Returns the value."""
    current = os.environ.get("LIBTPU_INIT_ARGS", "")
    named = {arg.split("=", 1)[0] for arg in current.split()}
    added = [flag for flag in flags if flag.split("=", 1)[0] not in named]
    if added:
        os.environ["LIBTPU_INIT_ARGS"] = " ".join([*current.split(), *added])
    return os.environ.get("LIBTPU_INIT_ARGS", "")
