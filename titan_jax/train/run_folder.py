"""Where a run's files live: a local folder, or a URL (`gs://bucket/runs/8b`, `file:///...`).

A run appends to its metrics, logs through a FileHandler, and TensorBoard and the profiler
write event files: all want a local file system. For a URL run folder those files go to a
mirror on this machine (`$XDG_CACHE_HOME/titan_jax/runs/NAME-HASH-pN`, process N) and are
copied to the URL, each changed file whole (a temporary name, then moved over the old one),
at every checkpoint save, at logged steps at most every `SYNC_SECONDS`, and when the run
ends for any reason but a kill (the mirror is then deleted). A resume, on this machine or
another, starts by copying the URL's top-level files (metrics, log) into a fresh mirror. What
is large or shared is written to the URL itself: orbax writes the checkpoints there
(TensorStore's GCS driver for gs://) and the token store is built there.

One run per URL: process 0 holds a lease, `.titan-jax.lease` in the run folder, created only
if absent (GCS: if-generation-match=0), naming its holder and an expiry it renews every
`LEASE_SECONDS / 5` and deletes when the run ends. A run killed without deleting it holds
the folder until the lease lapses, `LEASE_SECONDS` after its last renewal, except on its own
host, where a dead PID frees it at once (a restarted VM resumes without waiting).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import jax

from titan_jax.config import JobConfig
from titan_jax.data.paths import filesystem, join
from titan_jax.train.run_lock import RunLockError, pid_alive

LEASE_FILE = ".titan-jax.lease"
LEASE_SECONDS = 300.0
SYNC_SECONDS = 60.0
log = logging.getLogger(__name__)


def is_url(folder: str) -> bool:
    return "://" in folder


def orbax_location(url: str) -> str:
    """What orbax takes for a run folder URL: the path a file:// URL names, else the URL."""
    return url.removeprefix("file://")


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """The places of one run. `url`: the run folder as given, when it is a URL (else None);
    `local`: where the run's own files are written (the run folder, or its mirror);
    `checkpoints`: the checkpoint folder, a path or a URL that orbax writes to;
    `hf_exports`: where `checkpoint.last_save_in_hf` writes (for a URL run, the checkpoint
    folder's place in the mirror: the sync copies it to the URL)."""

    url: str | None
    local: Path
    checkpoints: str
    hf_exports: Path


def mirror_folder(url: str, process_index: int = 0) -> Path:
    """This machine's mirror of a URL run folder: one per URL and process."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = url.rstrip("/").rsplit("/", 1)[-1][:64] or "run"
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]
    return cache / "titan_jax" / "runs" / f"{name}-{digest}-p{process_index}"


def run_paths(config: JobConfig) -> RunPaths:
    """The places of this process's run (processes of one URL run have mirrors of their own,
    as they may share a host)."""
    dump, folder = config.job.dump_folder, config.checkpoint.folder
    if not is_url(dump):
        return RunPaths(None, Path(dump), str(Path(dump) / folder), Path(dump) / folder)
    local = mirror_folder(dump, jax.process_index())
    if Path(folder).is_absolute():
        return RunPaths(dump, local, folder, Path(folder))
    return RunPaths(dump, local, join(orbax_location(dump), folder), local / folder)


class Lease:
    """Context manager: the lease of one URL run folder (see the module docstring).
    `check()` raises RunLockError once the lease was found taken by someone else."""

    def __init__(self, url: str, field: str = "job.dump_folder"):
        self.url, self.field = url, field
        self.where = join(url, LEASE_FILE)
        self.fs, self.path = filesystem(self.where)
        self.host, self.pid, self.token = socket.gethostname(), os.getpid(), uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost: str | None = None

    def _record(self) -> bytes:
        return json.dumps(
            {
                "host": self.host,
                "pid": self.pid,
                "token": self.token,
                "expires": time.time() + LEASE_SECONDS,
            }
        ).encode()

    def _read(self) -> dict | None:
        try:
            record = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:  # torn or not ours: taken as lapsed
            return {}
        return record if isinstance(record, dict) else {}

    def _lapsed(self, held: dict) -> bool:
        try:
            if held["host"] == self.host and not pid_alive(int(held["pid"])):
                return True
            return float(held["expires"]) < time.time()
        except (KeyError, TypeError, ValueError):
            return True

    def __enter__(self) -> Lease:
        try:
            self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(self.path, self._record(), mode="create")
        except FileExistsError:
            held = self._read()
            if held and not self._lapsed(held):
                raise RunLockError(self._busy(held)) from None
            log.warning(
                f"{self.where}: taking over the lease of a run that is gone "
                f"({held.get('host')} pid {held.get('pid')}); it did not exit cleanly"
                if held
                else f"{self.where}: taking over an unreadable lease"
            )
            self.fs.pipe_file(self.path, self._record())
        except OSError as e:
            raise RunLockError(f"{self.field}={self.url} is not writable: {e}") from None
        self._confirm()
        self._renewer = threading.Thread(target=self._renew, name="titan-jax-lease", daemon=True)
        self._renewer.start()
        return self

    def _confirm(self) -> None:
        """Two runs taking over one lapsed lease both write it: the last write wins."""
        held = self._read()
        if not held or held.get("token") != self.token:
            raise RunLockError(self._busy(held or {}))

    def _busy(self, held: dict) -> str:
        until = time.strftime("%H:%M:%S", time.localtime(float(held.get("expires", 0))))
        return (
            f"{self.field}={self.url} is in use by another run ({held.get('host')} pid "
            f"{held.get('pid')}, lease {self.where}, renewed until {until}); wait for it "
            "to finish. A run that was killed holds it until then; if no run uses the "
            f"folder, delete {self.where}"
        )

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 5):
            try:
                held = self._read()
                if held is None or held.get("token") != self.token:
                    self.lost = (
                        f"{self.field}={self.url}: this run's lease {self.where} was "
                        "deleted or taken by another run; stopping so that the two "
                        "do not write one folder"
                    )
                    return
                self.fs.pipe_file(self.path, self._record())
            except OSError as e:  # the bucket is unreachable for a while: the next try may do
                log.warning(f"{self.where}: renewing the lease failed: {e}")

    def check(self) -> None:
        if self.lost:
            raise RunLockError(self.lost)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        try:
            held = self._read()
            if held and held.get("token") == self.token:
                self.fs.rm_file(self.path)
        except OSError as e:
            log.warning(f"{self.where}: could not delete the lease ({e}); it lapses by itself")


class RunMirror:
    """Context manager keeping a URL run folder and this process's mirror of it in step.
    Process 0 takes the lease and copies the run's earlier files in; every process copies out
    what it wrote (the others write only their own log)."""

    def __init__(self, paths: RunPaths, main: bool):
        assert paths.url is not None
        self.url, self.local, self.main = paths.url, paths.local, main
        self.fs, self.root = filesystem(paths.url)
        self.lease = Lease(paths.url) if main else None
        self._sent: dict[str, tuple[int, int]] = {}
        self._last_sync = time.monotonic()

    def __enter__(self) -> RunMirror:
        if self.lease is not None:
            self.lease.__enter__()
        try:
            shutil.rmtree(self.local, ignore_errors=True)  # the URL is the run's record
            self.local.mkdir(parents=True)
            if self.main:
                self._copy_in()
        except BaseException:
            if self.lease is not None:
                self.lease.__exit__()
            raise
        return self

    def _copy_in(self) -> None:
        """The run folder's top-level files (metrics, header, logs): what a resume appends to."""
        if not self.fs.isdir(self.root):
            return
        for info in self.fs.ls(self.root, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info["type"] == "file" and name != LEASE_FILE and not name.startswith(".tmp-"):
                target = self.local / name
                self.fs.get_file(info["name"], str(target))
                self._sent[name] = _signature(target)

    def sync(self) -> None:
        """Copies every file changed since the last sync to the URL."""
        if self.lease is not None:
            self.lease.check()
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            name = path.relative_to(self.local).as_posix()
            signature = _signature(path)
            if self._sent.get(name) == signature:
                continue
            target = f"{self.root.rstrip('/')}/{name}"
            parent, base = target.rsplit("/", 1)
            temporary = f"{parent}/.tmp-{uuid.uuid4().hex[:8]}-{base}"
            self.fs.makedirs(parent, exist_ok=True)
            self.fs.put_file(str(path), temporary)
            self.fs.mv(temporary, target)
            self._sent[name] = signature
        self._last_sync = time.monotonic()

    def sync_now_and_then(self) -> None:
        """At a logged step: a sync if the last one is `SYNC_SECONDS` old."""
        if time.monotonic() - self._last_sync >= SYNC_SECONDS:
            self.sync()

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            self.sync()
        except Exception as e:
            if kind is None:
                raise
            log.warning(
                f"copying the run's files to {self.url} failed: {e}; they are in "
                f"{self.local} until this folder's next run starts a fresh mirror"
            )
        else:  # all of it is at the URL now
            shutil.rmtree(self.local, ignore_errors=True)
        finally:
            if self.lease is not None:
                self.lease.__exit__()


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
