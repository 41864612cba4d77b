"""The local tier of multi-tier checkpoints: orbax's emergency checkpoint manager with peer
restore (`orbax.checkpoint.experimental.emergency.p2p.CheckpointManager`) on each host's own
fast storage, saved every `checkpoint.local_interval` steps; the persistent tier is the run's
`Checkpointer`.

Each process writes only its own shards, under

    {checkpoint.local_folder}/mesh{shape}-{processes}p/process_{i}/
        run.json         the persistent folder of the run it serves (another run's is refused)
        {step}/state/    this process's shards of the TrainState (orbax OCDBT)
        {step}/data_iter/  the run record: the persistent tier's meta (checksums, resume
                         signature, tokens seen) with the data position, every process's copy

The mesh shape and process count name the folder: a run on another shape starts from the
persistent tier, as its shards would not line up with the saved ones.

A restore reads the newest step whose every shard some process holds (orbax's
`PeerSelector`): a process whose own folder lacks it (a replaced host, a wiped RAM disk)
fetches the files of the process at its place in another data-parallel replica over TCP
(orbax's `P2PNode`) and reads those. Only replicas across processes (`dp_replicate`, orbax's
replica axis, with each replica on processes of its own) give a process such a peer; without
one, a lost local folder leaves no complete local step, and the run resumes from the persistent
tier. If any process cannot read the chosen step, every process falls back to the persistent
tier together (train/start.py).
"""

from __future__ import annotations

import json
import logging
import shutil
from typing import Any

import grain.python as pygrain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args
from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager as p2p
from orbax.checkpoint.experimental.emergency.p2p import options as p2p_options
from orbax.checkpoint.path import step as step_paths

from titan_jax.parallel.mesh import MESH_AXES
from titan_jax.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    Restored,
    check_checksums,
    check_signature,
    first_line,
    save_record,
)
from titan_jax.train.checksums import in_host_memory
from titan_jax.train.step import TrainState
from titan_jax.train.trainer import Trainer

# Local steps each process keeps: the newest may be cut off on some hosts by a crash, so the
# one before stays until the next is finalized (orbax deletes the oldest after a save).
LOCAL_KEEP = 2
OWNER_FILE = "run.json"  # in each process's folder: the persistent tier of the run it serves

log = logging.getLogger(__name__)


class RunRecord:
    """The run's JSON record as orbax's data-iterator item (grain's checkpoint interface:
    state as bytes), so it is saved in every local step and fetched from a peer with it."""

    def __init__(self, record: dict[str, Any] | None = None):
        self.record = record

    def get_state(self) -> bytes:
        return json.dumps(self.record).encode()

    def set_state(self, state: bytes) -> None:
        self.record = json.loads(state)


def tier_folder(root: epath.PathLike, mesh: jax.sharding.Mesh) -> epath.Path:
    """This process's folder of the local tier under `checkpoint.local_folder`."""
    shape = "x".join(str(n) for n in mesh.devices.shape)
    return (
        epath.Path(root) / f"mesh{shape}-{jax.process_count()}p" / f"process_{jax.process_index()}"
    )


class LocalTier:
    """This process's local checkpoints and its peer service. Every process calls every
    method (the step registry is shared with a collective)."""

    def __init__(
        self,
        root: epath.PathLike,
        mesh: jax.sharding.Mesh,
        abstract_state: TrainState,
        *,
        interval: int,
        run_info: dict[str, Any],
        persistent: epath.PathLike,
    ):
        self.root = epath.Path(root)
        self.directory = tier_folder(root, mesh)
        self.run_info = run_info
        self._claim(str(epath.Path(persistent)))
        # orbax's local manager leaves the temporary folders of saves a kill cut off.
        for tmp in step_paths.all_temporary_paths(self.directory):
            shutil.rmtree(str(tmp.get()), ignore_errors=True)
        options = p2p_options.CheckpointManagerOptions(
            local=p2p_options.LocalCheckpointOptions(
                save_interval_steps=interval, max_to_keep=LOCAL_KEEP
            ),
            replica_axis_index=MESH_AXES.index("dp_replicate"),
        )
        self._manager = p2p.CheckpointManager(
            mesh, abstract_state, self.directory, None, options=options
        )
        self._saving: int | None = None

    def _claim(self, persistent: str) -> None:
        """Marks this process's folder as the local tier of the run whose persistent tier is
        `persistent`; refuses one of another run's (its steps would be read or deleted)."""
        owner = self.directory / OWNER_FILE
        other = json.loads(owner.read_text()).get("persistent") if owner.is_file() else None
        if other not in (None, persistent):
            raise CheckpointError(
                f"checkpoint.local_folder={self.root} holds the local checkpoints of the run "
                f"in {other}; give this run a local folder of its own"
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            owner.write_text(json.dumps({"persistent": persistent}))
        except OSError as e:
            raise CheckpointError(
                f"checkpoint.local_folder={self.root} is not writable: {e.strerror or e}"
            ) from None

    @classmethod
    def for_run(cls, trainer: Trainer, persistent: Checkpointer) -> LocalTier:
        c = trainer.plan.config.checkpoint
        return cls(
            c.local_folder,
            trainer.plan.mesh,
            trainer.abstract_state(),
            interval=c.local_interval,
            run_info=persistent.run_info,
            persistent=persistent.directory,
        )

    def newest_complete_step(self) -> int | None:
        """The newest step whose every shard some process holds."""
        self._manager.reload()
        return self._manager.latest_step()

    def save(
        self, step: int, state: TrainState, *, data_state: dict[str, Any], tokens_seen: int
    ) -> bool:
        """Starts saving `state` as local step `step`; returns whether the write goes on in
        the background (on CPU devices it finishes here: see `Checkpointer.save`)."""
        tree = dict(state)
        record = save_record(self.run_info, step, tree, tokens_seen=tokens_seen, model_only=False)
        record["data"] = data_state
        self.wait()
        self._saving = step
        try:
            self._manager.save(
                step,
                args=p2p_args.Composite(
                    state=ocp.args.PyTreeSave(tree),
                    data_iter=pygrain.PyGrainCheckpointSave(RunRecord(record)),
                ),
                force=True,
            )
            self._manager.check_for_errors()
        except Exception as e:
            raise CheckpointSaveError(
                f"saving local checkpoint step {step} to {self.directory} failed: {first_line(e)}"
            ) from e
        if in_host_memory(tree):
            self.wait()
            return False
        return True

    def wait(self) -> None:
        if self._saving is None:
            return
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            raise CheckpointSaveError(
                f"saving local checkpoint step {self._saving} to {self.directory} failed: "
                f"{first_line(e)}"
            ) from e
        finally:
            self._saving = None

    def restore(
        self, step: int, abstract_state: TrainState, *, signature: dict[str, Any]
    ) -> Restored | None:
        """Local step `step` (complete across the job) restored into `abstract_state`'s
        shardings, each process from its own folder or a peer's files; None, on every
        process, when any process could not read it (the caller falls back to the
        persistent tier)."""
        own = (self.directory / str(step) / "state").is_dir()
        where = f"local checkpoint step {step} in {self.root}"
        restored, failure = None, ""
        try:
            restored = self._manager.restore(
                step,
                args=p2p_args.Composite(
                    state=ocp.args.PyTreeRestore(abstract_state),
                    data_iter=pygrain.PyGrainCheckpointRestore(RunRecord()),
                ),
            )
        except (OSError, ValueError) as e:  # orbax's: no peer answered, unreadable files
            failure = first_line(e)
        flags = np.asarray(
            multihost_utils.process_allgather(np.array([restored is not None, own]))
        ).reshape(-1, 2)
        if restored is None or not flags[:, 0].all():
            failed = np.flatnonzero(~flags[:, 0]).tolist()
            log.warning("%s unreadable on processes %s: %s", where, failed, failure)
            return None
        record = restored["data_iter"].record
        state = dict(restored["state"])
        check_checksums(
            where,
            state,
            record["checksums"],
            lambda: f"delete {self.root} on every host to resume from the persistent checkpoints",
        )
        check_signature(where, record.get("resume", {}), signature)
        fetched = np.flatnonzero(~flags[:, 1].astype(bool)).tolist()
        if fetched:
            where += f" (process {', '.join(map(str, fetched))}: shards fetched from a peer)"
        return Restored(
            step=step,
            state=state,
            data_state=record["data"],
            tokens_seen=int(record["tokens_seen"]),
            source=where,
        )

    def discard_after(self, step: int) -> None:
        """Removes this process's local steps after `step` (a resume from `step` saves them
        again; orbax refuses to save over a step). The folders are this process's own, and
        the processes hold different steps: orbax's `delete` is a collective over all."""
        for path in self.directory.iterdir():
            if path.name.isdigit() and int(path.name) > step:
                shutil.rmtree(str(path))
        self._manager.reload()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> LocalTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
