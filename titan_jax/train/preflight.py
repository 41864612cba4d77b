"""What a run checks before it writes anything: every folder and file it will write, and that
its outputs never mix with another run's.

`check_outputs` runs before the run's lock is taken (nothing exists yet that it did not find);
`check_history` once the lock is held (no other run can change the folder under it). Both only
read: a run they refuse leaves the dump folder exactly as it was.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from etils import epath

from titan_jax.config import ConfigError, JobConfig
from titan_jax.data.paths import filesystem, local_path
from titan_jax.errors import long_name, name_too_long
from titan_jax.train.checkpoint import CheckpointError, is_checkpoint_dir, listing
from titan_jax.train.goodput import RECORD_FILE
from titan_jax.train.run_folder import is_url, run_paths

METRICS_FILE = "metrics.jsonl"


def folder_to_write(path: Path, field: str) -> None:
    """`path` (a folder the run will create or write into) is not a file, nor under one, and
    its names fit the file system."""
    if (too_long := long_name(path)) is not None:  # found before a parent is created
        raise ConfigError(f"{field}={path}: {too_long}")
    try:
        for p in (path, *path.parents):
            if p.is_symlink() and not p.exists():  # mkdir would say only "File exists"
                raise ConfigError(
                    f"{field}={path}: {p} is a broken symbolic link (to "
                    f"{os.readlink(p)}); remove it, or make it point at a folder"
                )
            if p.exists():
                if not p.is_dir():
                    where = "is" if p == path else f"lies under {p}, which is"
                    raise ConfigError(f"{field}={path} {where} a file, not a folder")
                if not os.access(p, os.W_OK | os.X_OK):
                    raise ConfigError(f"{field}={path} is not writable: Permission denied ({p})")
                return
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise
        raise ConfigError(f"{field}={path}: {name_too_long(path)}") from None


def check_output_file(path: str | Path, flag: str) -> None:
    """A report file the command writes at the end (`--json OUT`): checked before the work."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{flag} {path} is a folder; name a file to write, e.g. {path}/report.json"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path} is not writable: Permission denied")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: folder {parent} is not writable: Permission denied")


def check_outputs(config: JobConfig) -> None:
    """Every path the run writes is writable and of the right kind: the dump folder (for a URL
    run folder, its local mirror: the URL itself is first written by taking its lease),
    metrics.jsonl, the TensorBoard, profile and checkpoint folders, the final HF export."""
    paths = run_paths(config)
    for url in (paths.url, paths.checkpoints):
        if url is not None and is_url(url):
            filesystem(url)  # an unsupported scheme or an unreachable bucket: one line, at once
    dump = paths.local
    folder_to_write(dump, "job.dump_folder")
    metrics = dump / METRICS_FILE
    if metrics.is_dir() or (metrics.exists() and not metrics.is_file()):
        raise ConfigError(f"{metrics} is not a file; move it out of job.dump_folder={dump}")
    if metrics.exists() and not os.access(metrics, os.W_OK):
        raise ConfigError(
            f"{metrics} is not writable: Permission denied (it is where the run logs its metrics)"
        )
    if config.metrics.enable_tensorboard:
        folder_to_write(dump / config.metrics.save_tb_folder, "metrics.save_tb_folder")
    if config.profiling.enable_profiling:
        folder_to_write(dump / config.profiling.save_traces_folder, "profiling.save_traces_folder")
    c = config.checkpoint
    if c.enable and not is_url(paths.checkpoints):
        folder_to_write(Path(paths.checkpoints), "checkpoint.folder")
    if c.enable and c.last_save_in_hf:
        final = epath.Path(paths.checkpoints) / f"hf-{config.training.steps}"
        if final.exists() or (paths.hf_exports / final.name).exists():
            raise ConfigError(
                f"checkpoint.last_save_in_hf: {final} already exists and the run would write "
                f"its final model there; move it out of {final.parent}, or use another "
                "job.dump_folder"
            )


def own_steps(config: JobConfig) -> list[int]:
    """The finalized steps in the run's own checkpoint folder (read only, nothing created)."""
    folder = epath.Path(run_paths(config).checkpoints)
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if is_checkpoint_dir(p))


def _logged_steps(path: Path, key: str) -> list[int]:
    """The steps of metrics.jsonl's rows (`key` "step") or of goodput.jsonl's records
    (`key` "steps": the first and last step each one covers)."""
    steps = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                value = json.loads(line)[key]
                steps.extend(int(s) for s in (value if isinstance(value, list) else [value]))
            except (ValueError, KeyError, TypeError):  # torn by a crash
                continue
    return steps


def check_history(config: JobConfig) -> None:
    """A run that does not resume must not write into a folder that holds another run's
    metrics or checkpoints: its history would be cut and mixed with this one's, and a later
    resume of the old checkpoints would leave holes in it."""
    paths = run_paths(config)
    dump = paths.url or paths.local
    checkpoints = own_steps(config)
    if config.checkpoint.enable and checkpoints:
        return  # a resume: the rows logged after its step are this run's own, logged again
    # A URL's files were copied in by RunMirror.
    logged = {
        what: (name, steps)
        for what, name, key in (
            ("metrics", METRICS_FILE, "step"),
            ("goodput records", RECORD_FILE, "steps"),
        )
        if (steps := _logged_steps(paths.local / name, key))
    }
    if not logged and not checkpoints:
        return
    held = [
        f"the {what} of steps {min(steps)}-{max(steps)} ({name})"
        for what, (name, steps) in logged.items()
    ]
    if checkpoints:
        held.append(f"checkpoints {listing(checkpoints)} ({paths.checkpoints})")
    files = " and ".join(
        name for name in (METRICS_FILE, RECORD_FILE) if (paths.local / name).exists()
    )
    hint = (
        "resume that run with --checkpoint.enable true, or use a new job.dump_folder"
        if checkpoints
        else f"use a new job.dump_folder, or move {files} out of it"
    )
    raise ConfigError(
        f"job.dump_folder={dump} holds {' and '.join(held)} of another run; this "
        f"run starts at step 1 and would mix the two histories: {hint}"
    )


def check_initial_load_path(config: JobConfig) -> None:
    """A missing or misdescribed `initial_load_path` fails before the run creates any folder.
    A run that will resume ignores it, as in TorchTitan."""
    c = config.checkpoint
    if not c.initial_load_path or (c.enable and own_steps(config)):
        return
    path = local_path(c.initial_load_path, "checkpoint.initial_load_path")
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path={path} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint.initial_load_path={path} is a file; give a "
            "checkpoint folder, a step folder, or a model directory"
        )
    is_hf = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    if is_hf and not c.initial_load_in_hf:
        raise CheckpointError(
            f"checkpoint.initial_load_path={path} is a HF model directory (config.json + "
            "safetensors); add --checkpoint.initial_load_in_hf true to load it"
        )
    if c.initial_load_in_hf and not is_hf:
        raise CheckpointError(
            f"checkpoint.initial_load_path={path} is not a HF model directory (no config.json "
            "and *.safetensors), but checkpoint.initial_load_in_hf=true"
        )
