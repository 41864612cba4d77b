"""URL run folders: the lease (one run per URL) and the mirror's copies in and out, on fsspec's
memory and local file systems. A whole run killed and resumed on a file:// URL is in
test_resume.py."""

import json
import socket
import subprocess
import sys
import time

import fsspec
import pytest

from titan_jax.config import ConfigError, load_config
from titan_jax.train import run_folder
from titan_jax.train.run_folder import (
    LEASE_FILE,
    Lease,
    RunMirror,
    RunPaths,
    mirror_folder,
    run_paths,
)
from titan_jax.train.run_lock import RunLockError


@pytest.fixture
def url(request):
    """A fresh memory:// folder per test (fsspec's memory file system is process-wide)."""
    name = f"memory://runs/{request.node.name}"
    yield name
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


def _write_lease(url, **record):
    fsspec.filesystem("memory").pipe_file(f"{url}/{LEASE_FILE}", json.dumps(record).encode())


def test_a_live_lease_refuses_and_its_hint_works(url):
    _write_lease(url, host="another-host", pid=1, token="t", expires=time.time() + 300)
    with pytest.raises(
        RunLockError,
        match=rf"job.dump_folder={url} is in use by another run "
        r"\(another-host pid 1, .*if no run uses the folder, delete "
        rf"{url}/{LEASE_FILE}$",
    ):
        Lease(url).__enter__()
    fsspec.filesystem("memory").rm_file(f"{url}/{LEASE_FILE}")  # the hint, followed
    with Lease(url) as lease:
        assert json.loads(lease.fs.cat_file(lease.path))["token"] == lease.token
    assert not lease.fs.exists(lease.path)  # released


def test_a_lapsed_lease_or_a_dead_holder_on_this_host_is_taken_over(url, caplog):
    _write_lease(url, host="another-host", pid=1, token="t", expires=time.time() - 1)
    with Lease(url):
        pass
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    _write_lease(
        url, host=socket.gethostname(), pid=int(dead), token="t", expires=time.time() + 300
    )
    with Lease(url):
        pass
    assert caplog.text.count("taking over the lease of a run that is gone") == 2


def test_a_lease_taken_from_a_running_run_stops_it(url, monkeypatch):
    monkeypatch.setattr(run_folder, "LEASE_SECONDS", 0.05)  # renewed every 10 ms
    with Lease(url) as lease:
        _write_lease(url, host="another-host", pid=1, token="theirs", expires=time.time() + 300)
        deadline = time.monotonic() + 10
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RunLockError, match="was deleted or taken by another run"):
            lease.check()
    assert json.loads(lease.fs.cat_file(lease.path))["token"] == "theirs"  # theirs stays


def test_the_mirror_copies_changed_files_out_and_a_resume_copies_them_in(
    url, tmp_path, monkeypatch
):
    def paths_on(machine):  # (memory:// is no run folder for a whole run: orbax cannot write it)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / machine))
        local = mirror_folder(url)
        return RunPaths(url, local, f"{url}/checkpoint", local / "checkpoint")

    paths = paths_on("machine-1")
    fs = fsspec.filesystem("memory")
    with RunMirror(paths, main=True) as mirror:
        assert fs.exists(f"{url}/{LEASE_FILE}")
        (paths.local / "metrics.jsonl").write_text('{"step": 1}\n')
        (paths.local / "tb").mkdir()
        (paths.local / "tb" / "events").write_bytes(b"x")
        mirror.sync()
        assert fs.cat_file(f"{url}/metrics.jsonl") == b'{"step": 1}\n'
        assert fs.cat_file(f"{url}/tb/events") == b"x"
        fs.pipe_file(f"{url}/tb/events", b"changed at the URL")  # not changed here: not sent
        with open(paths.local / "metrics.jsonl", "a") as f:
            f.write('{"step": 2}\n')
    assert fs.cat_file(f"{url}/metrics.jsonl") == b'{"step": 1}\n{"step": 2}\n'  # at exit
    assert fs.cat_file(f"{url}/tb/events") == b"changed at the URL"
    assert not fs.exists(f"{url}/{LEASE_FILE}") and not paths.local.exists()
    assert not [p for p in fs.find(url) if "/.tmp-" in p]

    paths = paths_on("machine-2")  # a resume elsewhere
    with RunMirror(paths, main=True):
        assert (paths.local / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
        assert not (paths.local / "tb").exists()  # only what a resume appends to


def test_run_folder_urls_and_paths(tmp_path):
    folder = tmp_path / "my run"
    config = load_config(
        None,
        [
            "--job.dump_folder",
            "file://" + str(folder).replace(" ", "%20"),
            "--checkpoint.folder",
            f"file://{tmp_path}/ckpt",
        ],
    )
    assert (config.job.dump_folder, config.checkpoint.folder) == (
        f"file://{folder}",
        f"{tmp_path}/ckpt",
    )
    paths = run_paths(load_config(None, ["--job.dump_folder", "gs://bucket/runs/8b"]))
    assert (paths.url, paths.checkpoints) == (
        "gs://bucket/runs/8b",
        "gs://bucket/runs/8b/checkpoint",
    )
    assert paths.hf_exports == paths.local / "checkpoint"  # copied to the URL by the sync
    with pytest.raises(
        ConfigError,
        match=r"^job.dump_folder='memory://runs/x' is a memory:// "
        "URL; a run folder is a local path or a gs:// or file:// URL",
    ):
        load_config(None, ["--job.dump_folder", "memory://runs/x"])
    with pytest.raises(
        ConfigError,
        match="checkpoint.folder is a path, inside job.dump_folder "
        "or absolute: .* \\(--job.dump_folder gs://BUCKET/runs/NAME\\)",
    ):
        load_config(None, ["--checkpoint.folder", "gs://bucket/ckpt"])
    with pytest.raises(ConfigError, match="names host 'host'"):
        load_config(None, ["--job.dump_folder", "file://host/run"])
    # `file:run` (no //) is the relative path fsspec reads it as, for pathlib's readers too:
    # one run folder, not a "file:run" folder beside a "run" one.
    relative = load_config(
        None, ["--job.dump_folder", "file:runs/a", "--checkpoint.folder", "file:ckpt"]
    )
    assert (relative.job.dump_folder, relative.checkpoint.folder) == ("runs/a", "ckpt")
    assert run_paths(relative).checkpoints == "runs/a/ckpt"
