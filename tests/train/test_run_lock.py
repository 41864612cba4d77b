"""One run per dump folder (titan_jax/train/run_lock.py), and the run's log file
(titan_jax/train/run_log.py)."""

import logging
import os
import socket

import jax
import pytest

from titan_jax.cli import main
from titan_jax.config import ConfigError
from titan_jax.train.checkpoint import CheckpointSaveError
from titan_jax.train.run_lock import LOCK_FILE, RunLock, RunLockError
from titan_jax.train.run_log import RunLog

ME = f"{socket.gethostname()} pid {os.getpid()}"


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path / "run"):
        assert (tmp_path / "run" / LOCK_FILE).read_text() == ME + "\n"
        with pytest.raises(RunLockError, match=f"is in use by another run \\({ME}, lock "):
            RunLock(tmp_path / "run").__enter__()
    assert not (tmp_path / "run" / LOCK_FILE).exists()  # released and removed
    with RunLock(tmp_path / "run"):  # free again
        pass


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    (tmp_path / LOCK_FILE).write_text(f"{socket.gethostname()} pid 999999999\n")  # killed run
    with caplog.at_level(logging.WARNING), RunLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == ME + "\n"
    assert "taking over the lock of a run that is gone" in caplog.text
    assert "pid 999999999" in caplog.text


def test_a_dump_folder_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="job.dump_folder=.*file is a file, not a folder"):
        RunLock(tmp_path / "file").__enter__()


def test_two_trainings_on_one_folder_at_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])
    with RunLock(tmp_path / "run"):
        code = main(
            [
                "train",
                "--training.seq_len",
                "16",
                "--training.local_batch_size",
                "1",
                "--job.dump_folder",
                str(tmp_path / "run"),
            ]
        )
    err = capsys.readouterr().err
    assert code == 2 and f"is in use by another run ({ME}" in err and err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # nothing written


def test_library_tracebacks_go_to_the_log_file(tmp_path, capsys):
    root = logging.getLogger()
    terminal = logging.StreamHandler()  # what the CLI's basicConfig installs
    root.addHandler(terminal)
    try:
        with pytest.raises(CheckpointSaveError) as error, RunLog(tmp_path):
            logging.getLogger("absl").error("orbax traceback line")
            try:
                raise OSError(28, "No space left on device")
            except OSError as e:
                raise CheckpointSaveError("No space left on device: saving failed") from e
    finally:
        root.removeHandler(terminal)
    assert "orbax traceback line" not in capsys.readouterr().err
    log = (tmp_path / "titan-jax.log").read_text()
    assert "orbax traceback line" in log and "OSError: [Errno 28]" in log
    assert (
        str(error.value) == f"No space left on device: saving failed (details in "
        f"{tmp_path / 'titan-jax.log'})"
    )
    assert terminal.filters == []  # restored


def test_a_run_that_logs_nothing_leaves_no_log_file(tmp_path):
    with RunLog(tmp_path):
        pass
    assert list(tmp_path.iterdir()) == []
