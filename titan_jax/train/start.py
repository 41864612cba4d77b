"""Where a run starts: its own newest checkpoint (resume), else `checkpoint.initial_load_path`
(a run's checkpoint, a converted orbax model or a HF directory), else random init."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import jax

from titan_jax.config import JobConfig
from titan_jax.data.paths import local_path
from titan_jax.models import BuildOptions
from titan_jax.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    Restored,
    check_shapes,
    is_checkpoint_dir,
    listing,
    resume_signature,
)
from titan_jax.train.model_io import load_orbax, read_orbax_args
from titan_jax.train.trainer import Trainer
from titan_jax.trees import named_leaves

if TYPE_CHECKING:  # imported by runs with a local tier only (grain is slow to import)
    from titan_jax.train.local_tier import LocalTier


def _newest_step(ckpt: Checkpointer) -> int:
    steps = ckpt.steps()
    if not steps:
        raise CheckpointError(f"{ckpt.directory} holds no finalized checkpoint")
    return steps[-1]


def _resume_step(config: JobConfig, ckpt: Checkpointer) -> int | None:
    steps, load_step = ckpt.steps(), config.checkpoint.load_step
    if load_step == -1:
        return steps[-1] if steps else None
    if load_step not in steps:
        raise CheckpointError(
            f"checkpoint.load_step={load_step} is not a finalized checkpoint in {ckpt.directory}; "
            f"available: {listing(steps)}"
        )
    newer = [s for s in steps if s > load_step]
    if newer and load_step < config.training.steps:
        # Training on would save over checkpoints of the abandoned future, one by one, and a
        # crash in between would leave a mix of both.
        raise CheckpointError(
            f"checkpoint.load_step={load_step} is older than checkpoints {listing(newer)} in "
            f"{ckpt.directory}, which this run would overwrite; move those out of that folder "
            "to roll back"
        )
    return load_step


def newest_tier(local_step: int | None, persistent_step: int | None) -> tuple[str, int] | None:
    """Where a resume starts: ("local", step) when the newest step complete across the job in
    the local tier is newer than the newest persistent one, else ("persistent", step); None
    when neither tier holds a step."""
    if local_step is not None and (persistent_step is None or local_step > persistent_step):
        return "local", local_step
    if persistent_step is not None:
        return "persistent", persistent_step
    return None


def load_start(
    trainer: Trainer, ckpt: Checkpointer | None, local: LocalTier | None = None
) -> Restored:
    """Where a run starts: its own newest (or `load_step`) checkpoint, else
    `initial_load_path` (orbax or HF), else random init (`Restored()` with no state).

    A resume always wins over `initial_load_path`, as in TorchTitan. A returned step at or
    past `training.steps` means there is nothing left to train (its state is not loaded).
    With a local tier (multi-tier checkpoints), its newest step complete across the job is
    taken when newer than the persistent tier's (not with `load_step`); its steps after the
    one the run starts from are then discarded, as the run saves them again.
    """
    start = _load_start(trainer, ckpt, local)
    if local is not None:
        local.discard_after(start.step)
    return start


def _load_start(trainer: Trainer, ckpt: Checkpointer | None, local: LocalTier | None) -> Restored:
    config = trainer.plan.config
    c = config.checkpoint
    if ckpt is None and c.load_step != -1:
        raise CheckpointError(f"checkpoint.load_step={c.load_step} needs checkpoint.enable=true")
    step = _resume_step(config, ckpt) if ckpt is not None else None
    note = ""
    if local is not None and ckpt is not None and c.load_step == -1:  # (local needs ckpt)
        tier = newest_tier(local.newest_complete_step(), step)
        if tier is not None and tier[0] == "local":
            restored = local.restore(
                tier[1],
                trainer.abstract_state(),
                signature=resume_signature(config, trainer.plan.global_batch_size),
            )
            if restored is not None:
                return restored
            note = f" (local checkpoint step {tier[1]} was unreadable on some process)"
            if step is None:
                raise CheckpointError(
                    f"local checkpoint step {tier[1]} in {local.root} is unreadable on some "
                    f"process and {ckpt.directory} holds no checkpoint to fall back to; "
                    f"delete {local.root} on every host to start afresh"
                )
    if ckpt is not None and step is not None:
        if step >= config.training.steps:
            return Restored(step=step, source=f"checkpoint {ckpt.directory / str(step)}")
        restored = ckpt.restore(
            step,
            trainer.abstract_state(),
            signature=resume_signature(config, trainer.plan.global_batch_size),
        )
        restored.source += note
        if c.initial_load_path:
            restored.source += " (checkpoint.initial_load_path ignored: a resume comes first)"
        return restored
    if not c.initial_load_path:
        return Restored()
    path = local_path(c.initial_load_path, "checkpoint.initial_load_path")
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path={c.initial_load_path} does not exist")
    if c.initial_load_in_hf or (path / "model_args.json").is_file():
        return _load_params(path, trainer)
    if is_checkpoint_dir(path):
        root, step = path.parent, int(path.name)
    else:
        root, step = path, None
    model_only = c.initial_load_model_only
    with Checkpointer(root, read_only=True) as source:
        step = _newest_step(source) if step is None else step
        abstract = trainer.abstract_state()
        trainable = trainer.plan.model.trainable
        if model_only and trainable and not trainable & source.saved_params(step):
            # A base model's run (no LoRA adapters): its weights, fresh adapters.
            abstract = {**abstract, "params": trainer.plain_base()}
        restored = source.restore(
            step,
            abstract,
            model_only=model_only,
            signature=resume_signature(config, trainer.plan.global_batch_size),
        )
    if model_only:
        assert restored.state is not None  # a restored step always holds its state
        restored.state = trainer.state_from_params(restored.state["params"])
        restored.source += " (model only)"
    return restored


def _load_params(path: Path, trainer: Trainer) -> Restored:
    """Weights from a HF directory, or from `titan-jax convert --to orbax` output: a base
    model's (LoRA's adapters start fresh)."""
    abstract = trainer.plain_base()
    shardings = jax.tree.map(lambda s: s.sharding, abstract)
    if trainer.plan.config.checkpoint.initial_load_in_hf:
        source = f"HF checkpoint {path}"
        params = trainer.plan.model_spec.hf.load_params(path, trainer.plan.model.args, shardings)
    else:
        source = f"converted orbax model {path}"
        spec = trainer.plan.model_spec
        saved = spec.build(read_orbax_args(path, spec), BuildOptions()).abstract_params
        # Before reading any array.
        check_shapes(source, named_leaves(saved), named_leaves(abstract), {})
        _, params = load_orbax(path, spec, shardings)
    check_shapes(source, named_leaves(params), named_leaves(abstract), {})
    return Restored(state=trainer.state_from_params(params), source=source)
