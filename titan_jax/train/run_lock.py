"""One run per folder: an flock'd `.titan-jax.lock` naming its holder, in the dump folder and in
the checkpoint folder (which may lie elsewhere: an absolute `checkpoint.folder`).

Two runs writing one folder would delete each other's in-flight checkpoints and interleave
their metrics. The lock is taken before a run writes anything and released (file removed) when
it ends; the kernel drops it if the process dies, so a lock file left behind by a killed run
names a dead process and is taken over with a warning. Where the filesystem has no flock, the
host and PID written in the file decide: a live process on this host still holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from titan_jax.config import ConfigError
from titan_jax.errors import TitanJaxError, name_too_long

LOCK_FILE = ".titan-jax.lock"
log = logging.getLogger(__name__)


class RunLockError(TitanJaxError):
    """Another run holds the dump folder."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _holder(text: str) -> tuple[str, int] | None:
    host, _, pid = text.strip().rpartition(" pid ")
    return (host, int(pid)) if host and pid.isdigit() else None


def prepare_dump_folder(folder: str | Path, field: str = "job.dump_folder") -> Path:
    """`folder` (the value of `field`), created if needed; a ConfigError if it is a file or
    cannot be made."""
    folder = Path(folder)
    try:
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{field}={folder} is a file, not a folder")
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise ConfigError(f"{field}={folder}: {name_too_long(folder)}") from None
        raise ConfigError(f"{field}={folder} is not writable: {e.strerror or e}") from None
    return folder


class RunLock:
    """Context manager holding the lock of `folder` for one run; `field` names the config field
    or flag the folder comes from, in messages. The lock file is `folder/.titan-jax.lock`
    (the folder is created), or `lock_file` for a folder that must stay empty until written
    whole (prepare-data's output: a hidden sibling, whose folder is created)."""

    def __init__(
        self, folder: str | Path, field: str = "job.dump_folder", lock_file: Path | None = None
    ):
        self.folder = Path(folder)
        self.field = field
        self.path = lock_file or self.folder / LOCK_FILE
        self._fd: int | None = None
        self.me = f"{socket.gethostname()} pid {os.getpid()}"

    def __enter__(self) -> RunLock:
        prepare_dump_folder(self.path.parent, self.field)
        while self._fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ConfigError(
                    f"{self.field}={self.folder} is not writable: {e.strerror or e}"
                ) from None
            try:
                self._take(fd)
            except BaseException:
                os.close(fd)
                raise
            # A run that released the lock between our open and flock removed the file: lock
            # the file that now has the name instead.
            if os.path.exists(self.path) and os.path.samestat(os.fstat(fd), os.stat(self.path)):
                self._fd = fd
            else:
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{self.me}\n".encode(), 0)
        return self

    def _take(self, fd: int) -> None:
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        holder = _holder(previous)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunLockError(self._busy(previous)) from None
            # No flock on this filesystem: the file's host and PID decide.
            if holder and holder[0] == socket.gethostname() and pid_alive(holder[1]):
                raise RunLockError(self._busy(previous)) from None
        if previous:  # the kernel released it: its holder died without cleaning up
            log.warning(
                f"{self.path}: taking over the lock of a run that is gone "
                f"({previous}); it did not exit cleanly"
            )

    def _busy(self, previous: str) -> str:
        return (
            f"{self.field}={self.folder} is in use by another run ({previous or 'unknown'}"
            f", lock {self.path}); wait for it to finish, or use another {self.field}"
        )

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # still locked: a newcomer that opened it re-checks the name
        except OSError:
            pass
        os.close(self._fd)  # releases the flock
        self._fd = None


@contextlib.contextmanager
def tidy_if_refused(folder: str | Path) -> Iterator[None]:
    """Around a run's setup in `folder`: if the folder is new and the run is refused (a
    TitanJaxError, e.g. a damaged input found while preparing it), the empty folders it made
    are removed again, so a refused run leaves nothing behind. Only empty folders go: never a
    file."""
    folder = Path(folder)
    fresh = not os.path.lexists(folder)
    try:
        yield
    except TitanJaxError:
        if fresh and folder.is_dir():
            for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
                    path.rmdir()
            if not any(folder.iterdir()):
                folder.rmdir()
        raise
