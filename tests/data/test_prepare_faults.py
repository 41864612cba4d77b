"""prepare-data under faults a user meets: a second run on the same output, a full disk or
read-only folder, absurd --workers, a name at the filesystem's limit, a killed parent, and a
remote output that fails part way and goes on."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from titan_jax.cli import main
from titan_jax.data import prepare
from titan_jax.train.run_lock import RunLock

ROOT = Path(__file__).parents[2]


def _source(folder: Path, files: int = 2, docs: int = 20) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (folder / f"{i:02d}.jsonl").write_text(
            "".join(
                json.dumps({"text": f"file {i} document {j} " + "word " * (j % 7)}) + "\n"
                for j in range(docs)
            )
        )
    return folder


def _argv(src: Path, output: str, *extra: str) -> list[str]:
    return [
        "prepare-data",
        "--training.dataset",
        "jsonl",
        "--training.dataset_path",
        str(src),
        "--output",
        output,
        *extra,
    ]


def test_a_second_run_on_the_same_output_is_refused_by_its_lock(tmp_path, capsys):
    src = _source(tmp_path / "src")
    out = tmp_path / "store"
    lock = tmp_path / ".store.titan-jax-lock"
    with RunLock(out, "--output", lock_file=lock):  # another prepare-data holds it
        assert main(_argv(src, str(out))) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"titan-jax: error: --output={out} is in use by another run (")
    assert f"lock {lock}); wait for it to finish, or use another --output" in err
    assert not out.exists() and not lock.exists()
    assert main(_argv(src, str(out))) == 0 and (out / "manifest.json").is_file()
    assert not lock.exists()  # released; the store's folder holds only the store
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "store"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_full_disk_or_read_only_folder_is_one_line_and_the_rerun_goes_on(
    tmp_path, capsys, monkeypatch, code
):
    src = _source(tmp_path / "src", files=3)
    out = tmp_path / "store"
    real = prepare._write_shard
    calls = []

    def failing(fs, folder, index, blocks, masked):
        calls.append(index)
        if len(calls) == 2:
            raise OSError(code, os.strerror(code), f"{folder}/tokens-{index:05d}.bin.tmp")
        return real(fs, folder, index, blocks, masked)

    monkeypatch.setattr(prepare, "_write_shard", failing)
    assert main(_argv(src, str(out))) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    partial = tmp_path / ".store.titan-jax-partial"
    assert err == (
        f"titan-jax: error: prepare-data --output {out}: {os.strerror(code)} "
        f"({partial}/tokens-00001.bin.tmp); fix that, then run the same command "
        "again: it goes on from the input files finished so far"
    )
    monkeypatch.setattr(prepare, "_write_shard", real)
    assert main(_argv(src, str(out))) == 0
    assert "00.jsonl: kept from an earlier run" in capsys.readouterr().err


def test_other_os_errors_keep_their_traceback(tmp_path, monkeypatch):
    src = _source(tmp_path / "src")

    def broken(*args):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(prepare, "_write_shard", broken)
    with pytest.raises(OSError, match="Bad file descriptor"):
        main(_argv(src, str(tmp_path / "store")))


def test_workers_beyond_the_machine_are_refused(tmp_path, capsys):
    src = _source(tmp_path / "src")
    cpus = os.cpu_count()
    assert main(_argv(src, str(tmp_path / "store"), "--workers", "3000000000")) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"titan-jax: error: --workers=3000000000 must be in [1, {4 * cpus}] (4 per CPU; this "
        f"machine has {cpus})"
    )
    assert not (tmp_path / "store").exists()


def test_an_output_name_at_the_filesystems_limit_works(tmp_path):
    """A 250-byte name is valid; its hidden siblings (partial store, lock) would pass 255."""
    src = _source(tmp_path / "src")
    out = tmp_path / ("s" * 250)
    assert main(_argv(src, str(out))) == 0
    assert (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src", out.name])


@pytest.mark.slow
def test_tokenizer_workers_end_with_a_killed_parent(tmp_path):
    src = _source(tmp_path / "src", files=6, docs=3000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "titan_jax.cli",
            *_argv(src, str(tmp_path / "store"), "--workers", "2"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def workers() -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    deadline = time.monotonic() + 120
    while len(workers()) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    children = workers()
    assert len(children) >= 2, "the pool never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    alive = children
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [
            p
            for p in alive
            if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
        ]
    assert alive == []


def test_a_remote_output_goes_on_after_a_failed_input_as_its_hint_says(tmp_path, capsys):
    src = _source(tmp_path / "src", files=3)
    good = (src / "01.jsonl").read_text()
    (src / "01.jsonl").write_text("{not json\n")
    out = "memory://bucket/remote-store"
    fs = fsspec.filesystem("memory")
    try:
        assert main(_argv(src, out)) == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.endswith(
            f"the input files finished so far are kept in {out}: the same "
            "command goes on from them once the file is fixed"
        )
        (src / "01.jsonl").write_text(good)
        assert main(_argv(src, out)) == 0
        assert "00.jsonl: kept from an earlier run" in capsys.readouterr().err
        assert fs.isfile("/bucket/remote-store/manifest.json")
        fs.pipe("/bucket/user-folder/notes.txt", b"mine")  # a folder of the user's: refused
        assert main(_argv(src, "memory://bucket/user-folder")) == 2
        assert "exists and is not a token store" in capsys.readouterr().err
    finally:
        fs.rm("/bucket", recursive=True)


def test_a_full_disk_while_train_prepares_its_store_is_one_line_and_leaves_no_run(
    tmp_path, capsys, monkeypatch
):
    """train prepares a jsonl dataset into a store under its run folder on first use; a disk
    that fills there ends the run in one line, with no run folder (or half store) left."""
    src = _source(tmp_path / "src")

    def full(fs, folder, index, blocks, masked):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{folder}/tokens-{index:05d}.bin")

    monkeypatch.setattr(prepare, "_write_shard", full)
    argv = ["train", "--config", str(ROOT / "configs" / "qwen3_debug.toml")]
    argv += ["--training.dataset", "jsonl", "--training.dataset_path", str(src)]
    argv += ["--training.steps", "1", "--validation.enable", "false"]
    assert main([*argv, "--job.dump_folder", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titan-jax: error: "), err
    assert os.strerror(errno.ENOSPC) in err[0], err
    assert not (tmp_path / "run").exists()
