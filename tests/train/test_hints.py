"""Every hint in a checkpoint error works when followed: each test hits the error, does what its
message says, and checks that the run then starts (tests/train/test_checkpoint.py has the rest
of the checkpoint tests)."""

import re
import shutil

import jax
import numpy as np
import pytest
from tiny_model import TINY

from titan_jax.config import load_config
from titan_jax.train.checkpoint import Checkpointer, CheckpointError
from titan_jax.train.start import load_start
from titan_jax.train.trainer import build_trainer


def make_config(folder, *overrides):
    return load_config(
        None,
        [
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "1",
            "--training.steps",
            "10",
            "--checkpoint.enable",
            "true",
            *overrides,
        ],
    )


def trainer_of(config):
    return build_trainer(config, jax.devices()[:1], model_args=TINY)


def save(dump, *steps, model_only=()):
    """Random states saved as `steps` of the run in `dump` (`model_only`: those steps only)."""
    trainer = trainer_of(make_config(dump))
    rng = np.random.default_rng(0)
    state = jax.tree.map(
        lambda a: jax.device_put(
            rng.standard_normal(a.shape).astype(a.dtype)
            if a.dtype == np.float32
            else np.zeros(a.shape, a.dtype),
            a.sharding,
        ),
        trainer.abstract_state(),
    )
    with Checkpointer.for_run(trainer) as ckpt:
        for step in steps:
            ckpt.save(step, state, data_state={}, tokens_seen=0, model_only=step in model_only)


def start(config):
    trainer = trainer_of(config)
    ckpt = Checkpointer.for_run(trainer) if config.checkpoint.enable else None
    try:
        return load_start(trainer, ckpt)
    finally:
        if ckpt is not None:
            ckpt.close()


def error_of(config) -> str:
    with pytest.raises(CheckpointError) as error:
        start(config)
    return str(error.value)


def corrupt(step_folder):
    """Truncates every data file of a saved state. Not just the largest: orbax spreads the arrays
    over several files in an order that depends on thread timing, so the largest may hold only
    optimizer state, which a model-only load never reads (the cause of this file's old flake)."""
    for data_file in (step_folder / "state").rglob("d/*"):
        data_file.write_bytes(data_file.read_bytes()[:10])


def move_out(message, tmp_path):
    """Does what "move {path} out of {folder}" says."""
    path, folder = re.search(r"move (\S+) out of (\S+?)(?:[ ;,]|$)", message).groups()
    assert path.startswith(folder)
    shutil.move(path, tmp_path / "moved-away")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_newest_checkpoint(tmp_path):
    config = make_config(tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoint"
    save(tmp_path / "run", 2, 4)
    corrupt(ckpt / "4")
    message = error_of(config)
    assert "run again to resume from step 2" in message
    move_out(message, tmp_path)
    assert start(config).step == 2


def test_a_final_model_only_checkpoint_both_ways(tmp_path):
    config = make_config(tmp_path / "run")
    save(tmp_path / "run", 2, 6, model_only=(6,))
    message = error_of(config)
    assert "holds only the model" in message
    # 1. "use a new job.dump_folder with --checkpoint.initial_load_path X"
    path = re.search(r"--checkpoint.initial_load_path (\S+?);", message)[1]
    fresh = make_config(tmp_path / "new", "--checkpoint.initial_load_path", path)
    restored = start(fresh)
    assert restored.step == 0 and "model only" in restored.source
    # 2. "to resume the full state of step 2 instead, move X out of Y"
    move_out(message, tmp_path)
    assert start(config).step == 2


def test_a_load_step_older_than_newer_checkpoints(tmp_path):
    config = make_config(tmp_path / "run", "--checkpoint.load_step", "2")
    ckpt = tmp_path / "run" / "checkpoint"
    save(tmp_path / "run", 2, 4)
    message = error_of(config)
    assert "older than checkpoints 4" in message and "move those out of that folder" in message
    shutil.move(ckpt / "4", tmp_path / "moved-away")
    assert start(config).step == 2


def test_a_folder_that_is_not_a_checkpoint_is_never_touched(tmp_path):
    config = make_config(tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoint"
    save(tmp_path / "run", 2)
    (ckpt / "7").mkdir()
    (ckpt / "7" / "holiday.jpg").write_bytes(b"mine")
    message = error_of(config)
    assert "holds 7/, which is not a titan-jax checkpoint" in message
    assert "delete" not in message
    assert Checkpointer(ckpt, read_only=True).steps() == [2]  # never listed as a step
    shutil.move(ckpt / "7", tmp_path / "7")  # "move it out of that folder"
    assert start(config).step == 2
    assert (tmp_path / "7" / "holiday.jpg").read_bytes() == b"mine"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_source_checkpoint_names_another_step(tmp_path):
    source = tmp_path / "source" / "checkpoint"
    save(source.parent, 2, 4)
    corrupt(source / "4")
    config = make_config(tmp_path / "run", "--checkpoint.initial_load_path", str(source))
    message = error_of(config)
    path = re.search(r"read another step's folder instead, e.g. (\S+)", message)[1]
    config = make_config(tmp_path / "run", "--checkpoint.initial_load_path", path)
    assert "model only" in start(config).source
