"""A resume on another shape (fewer or more processes or devices) keeps the checkpoint's global
batch, so that its batches, and so its losses, are the uninterrupted run's.

Each checkpoint's meta records the shape it was saved on (`Checkpointer.for_run`: processes,
devices, global batch, microbatches, rows per device). A resume whose devices differ, with
`training.global_batch_size` left at -1 (local x data-parallel degree, which would change with
the devices), takes the saved global batch instead: the rows each data-parallel rank holds
become microbatches of at most `training.local_batch_size` rows (fewer devices), or fewer rows
per device (more devices). A global batch set explicitly is kept as set. Either way the run says
in one line, at its start, what changed and what it adjusted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from titan_jax.config import ConfigError, JobConfig
from titan_jax.parallel.mesh import resolve_degrees
from titan_jax.train.checkpoint import Checkpointer, CheckpointError, is_checkpoint_dir
from titan_jax.train.run_folder import run_paths


def _saved_shape(config: JobConfig) -> dict[str, Any] | None:
    """The shape of the checkpoint this run would resume from, or None (no resume, a checkpoint
    from before shapes were recorded, or one the resume will refuse with its own error)."""
    c = config.checkpoint
    if not c.enable:
        return None
    folder = run_paths(config).checkpoints
    try:
        with Checkpointer(folder, read_only=True) as ckpt:
            steps = ckpt.steps()
            step = c.load_step if c.load_step != -1 else (steps[-1] if steps else None)
            if (
                step is None
                or step not in steps
                or not is_checkpoint_dir(ckpt.directory / str(step))
            ):
                return None
            shape = ckpt.meta(step).get("shape")
    except (CheckpointError, OSError, ValueError):
        return None
    return shape if isinstance(shape, dict) else None


def _processes(n: int) -> str:
    return f"{n} process{'es' if n > 1 else ''}"


def keep_saved_batch(config: JobConfig, n_devices: int) -> tuple[JobConfig, str | None]:
    """`config` with the saved global batch when the run resumes on another shape (see the
    module docstring), and the line that says so (None when the shape is the saved one)."""
    saved = _saved_shape(config)
    processes = jax.process_count()
    if saved is None or (saved["processes"], saved["devices"]) == (processes, n_devices):
        return config, None
    t = config.training
    dp = resolve_degrees(config.parallelism, n_devices).dp
    before = saved["global_batch_size"]
    if t.global_batch_size == -1:
        if before % dp:
            raise ConfigError(
                f"cannot keep the checkpoint's global batch of {before} sequences on this run's "
                f"{dp} data-parallel ranks ({n_devices} devices); set "
                "--training.global_batch_size to a multiple of "
                f"{dp} (the data goes on from the same position)"
            )
        per_rank = before // dp
        local = max(n for n in range(1, min(t.local_batch_size, per_rank) + 1) if per_rank % n == 0)
        config = dataclasses.replace(
            config,
            training=dataclasses.replace(t, global_batch_size=before, local_batch_size=local),
        )
        kept = f"global batch {before} kept"
    else:
        local = t.local_batch_size
        kept = (
            f"global batch {t.global_batch_size} (training.global_batch_size"
            f"{'' if t.global_batch_size == before else f'; the checkpoint had {before}'})"
        )
    microbatches = config.training.global_batch_size // (local * dp)
    rows = (
        ""
        if local == t.local_batch_size
        else f" (training.local_batch_size {t.local_batch_size} -> {local})"
    )
    return config, (
        f"resuming on {_processes(processes)} x {n_devices // processes} devices, the "
        f"checkpoint was saved on {_processes(saved['processes'])} x "
        f"{saved['devices'] // saved['processes']}: {kept} as {microbatches} microbatch(es) of "
        f"{local} row(s) x {dp} data-parallel ranks{rows}"
    )
