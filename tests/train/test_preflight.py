"""Nothing a user owns is lost: a run checks every folder and file it writes, and never mixes
its history with another run's, before it writes anything (titan_jax/train/preflight.py, the
order of titan_jax/train/loop.py's start)."""

import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_args import QUIET_METRICS
from tiny_model import TINY

from titan_jax.cli import main
from titan_jax.config import ConfigError, load_config
from titan_jax.errors import TitanJaxError
from titan_jax.train import loop
from titan_jax.train.checkpoint import Checkpointer, CheckpointError
from titan_jax.train.run_lock import RunLock, RunLockError
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
            "6",
            *QUIET_METRICS,
            "--checkpoint.enable",
            "true",
            *overrides,
        ],
    )


def digests(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


def old_metrics(folder, steps=(1, 2, 3, 4)):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 7.0 - s}) + "\n" for s in steps)
    )


@pytest.fixture
def tiny():
    """`loop.train` of the tiny model on one device."""
    return lambda config: loop.train(config, jax.devices()[:1], model_args=TINY)


def save_random(config, step, data_state):
    trainer = build_trainer(config, jax.devices()[:1], model_args=TINY)
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
        ckpt.save(step, state, data_state=data_state, tokens_seen=0)


@pytest.mark.parametrize("with_checkpoints", [False, True])
def test_a_fresh_run_never_mixes_its_history_with_another_runs(tmp_path, tiny, with_checkpoints):
    dump = tmp_path / "run"
    old_metrics(dump)
    if with_checkpoints:  # another run's checkpoints, and this run has checkpointing off
        save_random(make_config(dump), 4, {})
    before = digests(dump)
    with pytest.raises(ConfigError) as error:
        tiny(make_config(dump, "--checkpoint.enable", "false"))
    message = str(error.value)
    assert f"job.dump_folder={dump} holds the metrics of steps 1-4 (metrics.jsonl)" in message
    assert "would mix the two histories" in message
    if with_checkpoints:
        assert f"checkpoints 4 ({dump / 'checkpoint'})" in message
        assert "resume that run with --checkpoint.enable true" in message
    else:
        assert "use a new job.dump_folder, or move metrics.jsonl out of it" in message
    assert digests(dump) == before  # nothing cut, rewritten or added


def test_checkpoints_alone_of_another_run_are_refused_too(tmp_path, tiny):
    dump = tmp_path / "run"
    save_random(make_config(dump), 4, {})
    with pytest.raises(ConfigError, match=r"holds checkpoints 4 .* of another run"):
        tiny(make_config(dump, "--checkpoint.enable", "false"))
    assert not (dump / "metrics.jsonl").exists()


@pytest.mark.parametrize("folder", ["", ".", "./"])
def test_the_current_directory_is_never_a_dump_folder(tmp_path, capsys, monkeypatch, folder):
    monkeypatch.chdir(tmp_path)
    old_metrics(tmp_path)
    before = digests(tmp_path)
    assert main(["train", "--job.dump_folder", folder]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"titan-jax: error: job.dump_folder={folder!r} is the current directory; name "
        "a folder of its own for the run's outputs, e.g. outputs/my_run\n"
    )
    assert digests(tmp_path) == before


def test_a_resume_that_fails_its_checks_has_written_nothing(tmp_path, tiny):
    dump = tmp_path / "run"
    save_random(make_config(dump), 3, {"version": "from another titan-jax"})
    old_metrics(dump, steps=(1, 2, 3, 4))  # this run's own, with a step past its checkpoint
    before = digests(dump)
    with pytest.raises(
        CheckpointError,
        match="cannot resume from checkpoint .*/3: data iterator state has no version",
    ):
        tiny(make_config(dump))
    after = digests(dump)
    assert after.pop("titan-jax.log")  # the error's causes, which its message points at
    # The token store of the embedded corpus (a cache, derived from the inputs) may be built.
    after = {k: v for k, v in after.items() if not k.startswith("data/")}
    assert after == before  # metrics.jsonl still holds step 4


def test_two_runs_sharing_an_absolute_checkpoint_folder(tmp_path, tiny):
    shared = tmp_path / "shared_checkpoints"
    with RunLock(shared, "checkpoint.folder"):  # the first run, with its own dump folder
        with pytest.raises(
            RunLockError,
            match=f"checkpoint.folder={shared} is in use by another "
            f"run .*; wait for it to finish, or use another checkpoint.folder",
        ):
            tiny(make_config(tmp_path / "second", "--checkpoint.folder", str(shared)))
    assert os.listdir(shared) == []  # the second run wrote nothing there
    assert not (tmp_path / "second" / "metrics.jsonl").exists()


def test_a_fresh_run_refused_while_preparing_its_data_leaves_no_empty_folders(tmp_path, tiny):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a document"}\n{"text": \n')  # its second line is broken
    dump = tmp_path / "run"
    with pytest.raises(TitanJaxError):
        tiny(
            make_config(dump, "--training.dataset", "jsonl", "--training.dataset_path", str(corpus))
        )
    left = sorted(str(p.relative_to(dump)) for p in dump.rglob("*"))
    assert left == ["titan-jax.log"]  # the error's causes; no empty checkpoint/ or data/
