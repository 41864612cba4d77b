"""Checkpoints of a run: an orbax CheckpointManager under `{job.dump_folder}/{checkpoint.folder}`,
a local path or a gs:// URL (paths are `epath.Path`s, which are both).

One folder per finalized step. orbax writes `{step}.orbax-checkpoint-tmp*` and renames it to
`{step}` only once every item is complete, so a folder named by a bare number is a whole
checkpoint and anything else is a save that never finished (cleaned up at the next start):

    {step}/state/   the TrainState as one PyTree: params, opt_state, step, and any key added to
                    the state later (it is saved and restored by key, with nothing to register);
                    a model-only checkpoint holds just the `MODEL_KEYS`
    {step}/data/    the data iterator's JSON state (full checkpoints only)
    {step}/meta/    JSON: step, tokens seen, whether model-only, the config fields a resume must
                    keep (`resume_signature`), the model's Qwen3Args, the resolved config, the
                    shape it was saved on (processes, devices, global batch: resume_shape.py),
                    and one checksum per array
    hf-{step}/      the final model as HF safetensors (`checkpoint.last_save_in_hf`)

Restores go straight into abstract targets that carry the current run's shardings, so a
checkpoint saved on one mesh loads onto any other. Every array's checksum (a wrapping sum of its
raw bits, independent of sharding) is recorded at save and checked at restore: orbax itself does
not notice overwritten bytes (flipped bytes in a data file restore silently). The pass runs
where the arrays live, fused with the finite check: a save adds no host copy to orbax's own
(its one host copy of the state, written in the background).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import shlex
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from titan_jax.config import JobConfig
from titan_jax.errors import (
    TitanJaxError,
    quiet_closed_loop_callbacks,
    quiet_unstarted_reads,
    root_cause,
)
from titan_jax.train.checksums import checksums, in_host_memory
from titan_jax.train.run_folder import is_url, run_paths
from titan_jax.train.state_formats import count_from_schedule, schedule_counted
from titan_jax.train.step import TrainState
from titan_jax.train.trainer import Trainer
from titan_jax.trees import leaf_name, named_leaves

FORMAT_VERSION = 1
MODEL_KEYS = ("params", "buffers")  # the TrainState keys a model-only checkpoint holds


class CheckpointError(TitanJaxError, ValueError):
    """A checkpoint that cannot be used: missing, corrupt, another model, or another run."""


class CheckpointSaveError(TitanJaxError, OSError):
    """Writing a checkpoint failed (an async save fails in the background and shows up here at
    the next save or at exit)."""


class NonFiniteStateError(RuntimeError):
    """The train state holds NaN or inf; it is never saved."""


def resume_signature(config: JobConfig, global_batch_size: int) -> dict[str, Any]:
    """The config fields an exact resume depends on: the model's shapes and the data stream.

    Anything else (lr, steps, parallelism, mixed precision, ...) may change between runs. So
    may `seq_len` and the global batch size: the data continues at the same token position
    (a long-context continuation; `data.windows.WindowStream.set_state` says where).
    """
    t = config.training
    del global_batch_size  # kept in the signature's interface: the data state handles it
    return {
        "model.flavor": config.model.flavor,
        "training.dataset": t.dataset,
        "training.text_field": t.text_field,
        "training.seed": t.seed,
    }


@dataclasses.dataclass
class Restored:
    """Where a run starts. `state` None: from the trainer's random init."""

    step: int = 0
    state: TrainState | None = None
    data_state: dict[str, Any] | None = None
    tokens_seen: int = 0
    source: str = ""  # what was loaded, for the log


def is_checkpoint_dir(path: epath.PathLike) -> bool:
    """A step folder written by this project: a number holding its `state/` and `meta/` items.
    Anything else in a checkpoint folder is never read, listed or suggested for deletion."""
    path = epath.Path(path)
    return path.name.isdigit() and (path / "meta").is_dir() and (path / "state").is_dir()


def _refuse_foreign_steps(directory: epath.Path) -> None:
    """A numbered folder that is not ours would be taken for a step by orbax, and deleted by
    `keep_latest_k`: the run stops before touching it."""
    foreign = sorted(
        (p for p in directory.iterdir() if p.name.isdigit() and not is_checkpoint_dir(p)),
        key=lambda p: int(p.name),
    )
    if foreign:
        raise CheckpointError(
            f"checkpoint folder {directory} holds {foreign[0].name}/, which is not a titan-jax "
            "checkpoint (no state/ and meta/); move it out of that folder, or set "
            "checkpoint.folder to a folder that holds only this run's checkpoints"
        )


def _ensure_writable(directory: epath.Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint folder {directory} is not writable: {e.strerror or e}"
        ) from None


_DENIED = (os.strerror(errno.EACCES), os.strerror(errno.EPERM))


def permission_denied(e: BaseException) -> str | None:
    """`Permission denied (FILE)` when `e` is a read this user may not make (a file or folder
    of another user's), else None: such a file is not corrupt, and moving it aside is not the
    remedy."""
    cause = root_cause(e)
    if cause not in _DENIED:
        return None
    current: BaseException | None = e
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        if getattr(current, "filename", None):
            return f"{cause} ({current.filename})"
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return cause


def first_line(e: BaseException) -> str:
    """The first line of the deepest cause: orbax wraps TensorStore's own words (the file and
    what is wrong with it) in a message that dumps a whole spec."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line if len(line) <= 200 else line[:200] + "..."


def _with_dtypes(target: Any, dtypes: dict[str, Any]) -> Any:
    """`target` with each leaf's dtype replaced by the saved one (its shape and sharding kept)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, s: jax.ShapeDtypeStruct(s.shape, dtypes[leaf_name(p)], sharding=s.sharding),
        target,
    )


class Checkpointer:
    """The checkpoints in one folder: async save with atomic finalize, restore onto any mesh.

    Every process calls every method (orbax coordinates the writes). `run_info` is recorded in
    each step's meta item: the run's `resume_signature`, model args and config.
    """

    def __init__(
        self,
        directory: epath.PathLike,
        *,
        keep_latest_k: int = 0,
        async_save: bool = True,
        read_only: bool = False,
        run_info: dict[str, Any] | None = None,
        state_bytes: int = 0,
    ):
        directory = epath.Path(directory)
        self.directory = directory if is_url(str(directory)) else directory.absolute()
        if read_only:
            if not self.directory.is_dir():
                raise CheckpointError(f"checkpoint folder {self.directory} does not exist")
        else:
            _ensure_writable(self.directory)
            _refuse_foreign_steps(self.directory)
        self.read_only = read_only
        self.run_info = run_info or {}
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_latest_k or None,  # 0 keeps all
            cleanup_tmp_directories=not read_only,  # saves a crash left unfinished
            create=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
        )
        # TensorStore's encoded chunks in flight, bounded at a tenth of this process's share of
        # the state (at least orbax's 1 GB unit): unbounded, they grew to ~0.85x the state on
        # top of the snapshot (docs/notes/2026-12-03-checkpoint-saves.md).
        in_flight_gb = max(1, math.ceil(state_bytes / jax.process_count() / 10 / 1e9))
        # orbax warns that a read-only folder is read only: asked for, so not printed.
        absl_logger = logging.getLogger("absl")
        level = absl_logger.level
        if read_only:
            absl_logger.setLevel(max(level, logging.ERROR))
        try:
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                item_handlers={
                    "state": ocp.PyTreeCheckpointHandler(save_concurrent_gb=in_flight_gb),
                    "meta": ocp.JsonCheckpointHandler(),
                    "data": ocp.JsonCheckpointHandler(),
                },
            )
        finally:
            absl_logger.setLevel(level)
        self._saving: int | None = None  # step of a save that may still be in flight
        quiet_closed_loop_callbacks()  # a failed read's one-line error stays one line

    @classmethod
    def for_run(cls, trainer: Trainer) -> Checkpointer:
        """The checkpoints of the trainer's run (`checkpoint.*`, under its run folder)."""
        config = trainer.plan.config
        c = config.checkpoint
        run_info = {
            "resume": resume_signature(config, trainer.plan.global_batch_size),
            "model_args": dataclasses.asdict(trainer.plan.model.args),
            "config": config.to_dict(),
            "shape": {
                "processes": jax.process_count(),
                "devices": trainer.plan.mesh.devices.size,
                "global_batch_size": trainer.plan.global_batch_size,
                "microbatches": trainer.options.n_microbatches,
                "local_batch_size": config.training.local_batch_size,
            },
        }
        state_bytes = sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state())
        )
        return cls(
            run_paths(config).checkpoints,
            keep_latest_k=c.keep_latest_k,
            async_save=c.async_mode == "async",
            run_info=run_info,
            state_bytes=state_bytes,
        )

    def steps(self) -> list[int]:
        """Finalized steps, oldest first (our own step folders only: see is_checkpoint_dir)."""
        return sorted(
            s for s in self._manager.all_steps() if is_checkpoint_dir(self.directory / str(s))
        )

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data_state: dict[str, Any] | None,
        tokens_seen: int,
        model_only: bool = False,
        dtype: str | None = None,
    ) -> bool:
        """Starts saving `state` as `step` (returns once arrays are copied off the devices, so
        the caller may donate them). Returns whether the write goes on in the background.
        Raises NonFiniteStateError, saving nothing, if any floating array is not finite;
        CheckpointSaveError if an earlier async save failed.

        On CPU devices the write finishes here: orbax's host "copy" of an array in host memory
        is a view of the device buffer, so the next step, which donates that buffer, could not
        reuse it until the write let go, and ran beside it on a second set of buffers (a
        Qwen3-0.6B run was killed at 23 GB). Waiting costs no time there: that step waited for
        the write anyway."""
        tree = {k: state[k] for k in MODEL_KEYS} if model_only else dict(state)
        if dtype is not None:
            tree = jax.tree.map(
                lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
            )
        meta = save_record(
            self.run_info, step, tree, tokens_seen=tokens_seen, model_only=model_only
        )
        items = {"state": ocp.args.PyTreeSave(tree), "meta": ocp.args.JsonSave(meta)}
        if not model_only:
            if data_state is None:
                raise ValueError(f"step {step}: a full save needs data_state (the data position)")
            items["data"] = ocp.args.JsonSave(data_state)
        self.wait()  # the previous save's errors, named as its own
        self._saving = step
        with self._saving_errors(step):
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
            self._manager.check_for_errors()
        if in_host_memory(tree):
            self.wait()
            return False
        return self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Blocks until the last save is finalized; raises CheckpointSaveError if it failed."""
        with self._saving_errors(self._saving):
            self._manager.wait_until_finished()
        self._saving = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _saving_errors(self, step: int | None) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            which = "a checkpoint" if step is None else f"checkpoint step {step}"
            what = f"saving {which} to {self.directory} failed"
            cause = root_cause(e)  # first: orbax's own first line can bury it
            raise CheckpointSaveError(
                f"{cause}: {what}" if cause else f"{what}: {first_line(e)}"
            ) from e

    # Restore.

    def meta(self, step: int) -> dict[str, Any]:
        """The meta item of `step` (see the module docstring)."""
        with self._reading(step):
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
            if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"meta item is not a titan-jax v{FORMAT_VERSION} record")
        return meta

    def _saved_tree(self, step: int) -> Any:
        """The metadata tree of step `step`'s saved state (no array read)."""
        with self._reading(step):
            return (
                ocp.PyTreeCheckpointHandler()
                .metadata(self._manager.directory / str(step) / "state")
                .tree
            )

    def saved_params(self, step: int) -> set[str]:
        """The dotted names of step `step`'s saved params (e.g. "layers.attention.wq")."""
        return set(named_leaves(self._saved_tree(step).get("params", {})))

    def restore(
        self,
        step: int,
        abstract_state: TrainState,
        *,
        model_only: bool = False,
        signature: dict[str, Any] | None = None,
    ) -> Restored:
        """Step `step` restored into `abstract_state`'s shapes, dtypes and shardings.

        `model_only`: just the MODEL_KEYS (optimizer, step and data start afresh). Otherwise the
        whole state and data position; `signature`, when given, must equal the saved one.
        """
        where = f"checkpoint {self.directory / str(step)}"
        meta = self.meta(step)
        if not model_only and meta["model_only"]:
            raise CheckpointError(
                f"{where} holds only the model (checkpoint.last_save_model_only); it cannot "
                f"resume training. {self._model_only_hint(step)}"
            )
        wanted = (
            {k: abstract_state[k] for k in MODEL_KEYS if k in abstract_state}
            if model_only
            else abstract_state
        )
        saved = self._saved_tree(step)
        # A key with no arrays (a dense model's buffers) that the checkpoint lacks, because it
        # was written before the key existed, is not read: it has nothing to restore.
        empty = {k: v for k, v in wanted.items() if not jax.tree.leaves(v) and k not in saved}
        target = {k: v for k, v in wanted.items() if k not in empty}
        # A model-only restore reads the MODEL_KEYS of a full checkpoint and ignores the rest.
        saved = {n: m for n, m in named_leaves(saved).items() if n.split(".")[0] in target}
        target, uncounted = schedule_counted(target, saved)
        check_shapes(where, saved, named_leaves(target), meta)
        if signature is not None and not model_only:
            check_signature(where, meta.get("resume", {}), signature)

        restore_target = _with_dtypes(target, {n: m.dtype for n, m in saved.items()})
        restore_args = ocp.checkpoint_utils.construct_restore_args(restore_target)
        items: dict[str, ocp.args.CheckpointArgs] = {
            "state": ocp.args.PyTreeRestore(
                restore_target, restore_args=restore_args, partial_restore=model_only
            )
        }  # a subset of what was saved
        if not model_only:
            items["data"] = ocp.args.JsonRestore()
        with self._reading(step):
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        state = {**restored["state"], **empty}
        check_checksums(where, state, meta["checksums"], lambda: self._others(step))
        if uncounted:
            state = count_from_schedule(state)
        # A bf16 export restored into fp32 master weights (exact: bf16 values are fp32 values).
        state = jax.tree.map(
            lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype), state, wanted
        )
        return Restored(
            step=step if not model_only else 0,
            state=state,
            data_state=None if model_only else restored["data"],
            tokens_seen=0 if model_only else int(meta["tokens_seen"]),
            source=where,
        )

    @contextlib.contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            quiet_unstarted_reads()
            if (denied := permission_denied(e)) is not None:
                raise CheckpointError(
                    f"checkpoint {self.directory / str(step)} cannot be read: "
                    f"{denied}; make it readable by this user"
                ) from e
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} is unreadable (corrupt or truncated): "
                f"{first_line(e)}; {self._others(step)}"
            ) from e

    # Hints: each one works when followed (tests/train/test_hints.py follows them).

    def _others(self, step: int) -> str:
        """What to do about an unusable `step`."""
        others = [s for s in self.steps() if s != step]
        here = self.directory / str(step)
        if self.read_only:  # someone else's checkpoints, read as a source
            if not others:
                return "no other checkpoint here"
            return (
                f"read another step's folder instead, e.g. {self.directory / str(others[-1])}"
                f" (finalized: {listing(others)})"
            )
        if not others:
            return (
                f"move {here} out of {self.directory} to start afresh (no other checkpoint "
                "here), or use a new job.dump_folder"
            )
        return (
            f"move {here} out of {self.directory} and run again to resume from step "
            f"{others[-1]} (finalized: {listing(others)})"
        )

    def _model_only_hint(self, step: int) -> str:
        here = self.directory / str(step)
        if self.read_only:
            return "Load it as weights with checkpoint.initial_load_model_only=true"
        older = [s for s in self.steps() if s < step]
        hint = (
            f"To train on from its weights, use a new job.dump_folder with "
            f"--checkpoint.initial_load_path {shlex.quote(str(here))}"
        )
        if older:
            hint += (
                f"; to resume the full state of step {older[-1]} instead, move {here} out "
                f"of {self.directory}"
            )
        return hint


def save_record(
    run_info: dict[str, Any], step: int, tree: Any, *, tokens_seen: int, model_only: bool
) -> dict[str, Any]:
    """The meta record of a save of `tree` at `step` (see the module docstring), with one
    checksum per array. Raises NonFiniteStateError if any floating array is not finite."""
    sums, finite = checksums(tree)
    if not finite:
        raise NonFiniteStateError(
            f"the train state at step {step} holds NaN or inf values; not saving it"
        )
    return {
        **run_info,
        "format": FORMAT_VERSION,
        "step": step,
        "tokens_seen": tokens_seen,
        "model_only": model_only,
        "checksums": sums,
    }


def check_checksums(
    where: str, state: Any, saved: dict[str, int], remedy: Callable[[], str]
) -> None:
    """Raises CheckpointError naming the first array of `state` whose checksum differs from
    the one recorded at save (`remedy()`: what to do about it, asked only then)."""
    sums, _ = checksums(state)
    bad = next((n for n, v in sums.items() if saved.get(n) != v), None)
    if bad is not None:
        raise CheckpointError(
            f"{where} is corrupt: {bad} does not match the checksum recorded when it was "
            f"saved; {remedy()}"
        )


def listing(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def check_shapes(
    where: str, saved: dict[str, Any], expected: dict[str, Any], meta: dict[str, Any]
) -> None:
    flavor = meta.get("resume", {}).get("model.flavor")
    hint = f" (it was saved with model.flavor={flavor})" if flavor else ""
    # Parameters first: a model mismatch reads better as a weight than as its Adam moment.
    for name in sorted(expected, key=lambda n: not n.startswith("params.")):
        sds = expected[name]
        if name not in saved:
            raise CheckpointError(f"{where} has no {name}, which this run needs{hint}")
        shape = tuple(saved[name].shape)
        if shape != tuple(sds.shape):
            raise CheckpointError(
                f"{where} does not fit this model: {name} has shape {shape} in the checkpoint "
                f"but {tuple(sds.shape)} in the model{hint}"
            )
    extra = [n for n in saved if n not in expected]
    if extra:
        raise CheckpointError(f"{where} holds {extra[0]}, which this model does not have{hint}")


def check_signature(where: str, saved: dict[str, Any], current: dict[str, Any]) -> None:
    changed = [
        f"{k}={current[k]!r} (checkpoint: {saved.get(k)!r})"
        for k in current
        if saved.get(k) != current[k]
    ]
    if changed:
        raise CheckpointError(
            f"cannot resume from {where}: the config changed {', '.join(changed)}; set it back, "
            "or train in a new job.dump_folder"
        )
