"""Writing a directory the user owns: into a temporary sibling, renamed into place when complete.

A crash (even kill -9) part way leaves the destination exactly as it was, plus a hidden
`.{name}.titan-jax-tmp` sibling that the next write to that destination clears. An existing
non-empty destination is replaced only when the caller says so (`--overwrite`), and never when
it is, holds, or lies inside the source being read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from titan_jax.errors import TitanJaxError, long_name, root_cause


class DestinationError(TitanJaxError, ValueError):
    """A destination that must not be written: the source itself, or a folder of the user's."""


NAME_MAX = 255  # bytes in one path component (ext4, xfs, GCS object name parts too)


def hidden_name(name: str, what: str) -> str:
    """`.NAME.titan-jax-WHAT`, the hidden sibling of `name` that titan-jax writes through; a name
    too long for the extra characters is replaced by its hash (a 250-byte name is valid)."""
    hidden = f".{name}.titan-jax-{what}"
    if len(hidden.encode()) <= NAME_MAX:
        return hidden
    return f".{hashlib.sha256(name.encode()).hexdigest()[:32]}.titan-jax-{what}"


def _temporary(path: Path, what: str) -> Path:
    return path.with_name(hidden_name(path.name, what))


def check_names_fit(dst: str | Path) -> None:
    """Every name in `dst` fits its file system (a 300-byte folder name does not)."""
    if (too_long := long_name(dst)) is not None:
        raise DestinationError(f"destination {dst}: {too_long}")


def check_destination(
    dst: str | Path, *, overwrite: bool = False, source: str | Path | None = None
) -> Path:
    """`dst` resolved, or a DestinationError saying why it must not be written."""
    check_names_fit(dst)
    dst = Path(dst).resolve()
    if source is not None:
        src = Path(source).resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            raise DestinationError(
                f"destination {dst} is, holds or lies inside the source {src}; write to a new "
                "folder (a source is never overwritten)"
            )
    if dst.exists() and not dst.is_dir():
        raise DestinationError(f"destination {dst} is a file, not a folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise DestinationError(
            f"destination {dst} exists and is not empty; choose a new folder, or pass "
            "--overwrite to replace it"
        )
    return dst


def _normal_modes(root: Path) -> None:
    """Files readable as any file the user creates (0644 under the usual umask): some writers
    (safetensors) create 0600 temporary files and rename them into place."""
    umask = os.umask(0)
    os.umask(umask)
    for file in root.rglob("*"):
        if file.is_file() and not file.is_symlink():
            file.chmod(0o666 & ~umask)


@contextlib.contextmanager
def atomic_dir(
    dst: str | Path,
    *,
    overwrite: bool = False,
    source: str | Path | None = None,
    writer: bool = True,
) -> Iterator[Path]:
    """Yields a temporary sibling of `dst` to write into; on success it becomes `dst` (an old
    `dst` is replaced only with `overwrite`), on any error it is removed and `dst` is untouched.

    With several processes every one writes into the same temporary path; only the `writer`
    (process 0) prepares, renames and cleans up.
    """
    dst = check_destination(dst, overwrite=overwrite, source=source)
    tmp = _temporary(dst, "tmp")
    try:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
            tmp.mkdir(parents=True)
        yield tmp
    except BaseException as e:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = (
            None if isinstance(e, TitanJaxError) or not isinstance(e, Exception) else root_cause(e)
        )
        if cause is None:
            raise
        # the machine's refusal (a full disk, a folder of another user's), not a bug: one line
        raise DestinationError(f"{cause}: writing {dst} failed; {dst} is as it was before") from e
    if not writer:
        return
    _normal_modes(tmp)
    if dst.exists():  # empty, or replaced as asked
        old = _temporary(dst, "old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old)
    else:
        os.replace(tmp, dst)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes a report file: into a temporary sibling, renamed over `path` when complete, so a
    crash leaves the old file (or none) rather than half of the new one."""
    path = Path(path)
    tmp = _temporary(path, f"tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
