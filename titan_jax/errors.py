"""The project's own error type, and how to name the root cause of a wrapped failure.

`TitanJaxError` marks input a person can fix (a config field, a file, a folder): the CLI prints
its message as one line and exits 2. Anything else (a bug, an error from JAX or orbax) keeps its
traceback and exits 1, so real failures are never disguised as bad input.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

# Failures of the machine rather than of titan-jax: named first when a save or write fails.
_ENVIRONMENT_ERRNOS = (
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EIO,
)


class TitanJaxError(Exception):
    """Bad input: the message names the field or file, the value, and what would be valid."""


def root_cause(error: BaseException) -> str | None:
    """The environmental cause of `error` ("No space left on device", "Permission denied"), found
    in its chain of causes or, for libraries that re-raise errors as text, in their messages."""
    chain, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    for e in reversed(chain):  # the deepest one is the cause
        if isinstance(e, OSError) and e.errno in _ENVIRONMENT_ERRNOS:
            return os.strerror(e.errno)
    text = "\n".join(str(e) for e in chain)
    for code in _ENVIRONMENT_ERRNOS:
        if os.strerror(code) in text:
            return os.strerror(code)
    return None


def long_name(path: str | os.PathLike[str]) -> str | None:
    """What in `path` is past the bytes one name may have on its file system (NAME_MAX), for
    a one-line error; None when every name fits. Reads nothing but the limit: a long name under
    a folder that does not exist yet is found before anything is created."""
    path = os.path.abspath(path)
    name = max(path.split(os.sep), key=lambda n: len(os.fsencode(n)))
    size, limit = len(os.fsencode(name)), _name_max(path)
    if size <= limit:
        return None
    return (
        f"the name {name[:12]}...{name[-4:]} is {size} bytes, longer than the {limit} bytes "
        "a file name may have here; use a shorter name"
    )


def name_too_long(path: str | os.PathLike[str]) -> str:
    """Why the file system refused `path` with ENAMETOOLONG: a name too long, or else the whole
    path."""
    return long_name(path) or (
        f"the path is {len(os.fsencode(os.path.abspath(path)))} bytes, "
        "longer than the file system takes (File name too long); use a "
        "shorter path"
    )


def _name_max(path: str) -> int:
    existing = next((p for p in (path, *_parents(path)) if os.path.isdir(p)), os.sep)
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255  # ext4, xfs, btrfs


def _parents(path: str) -> Iterator[str]:
    while (parent := os.path.dirname(path)) != path:
        yield parent
        path = parent


def quiet_closed_loop_callbacks() -> None:
    """Drop the tracebacks that orbax's abandoned reads print after a failed read has raised its
    error; every other unraisable error is reported as before. Installed once for the process.

    orbax runs a restore's TensorStore reads on a fresh asyncio loop and closes it when the first
    read fails, with the other reads still in flight. Each of those then reports into
    `sys.unraisablehook`, around the one-line error that says what is wrong: a read finishing on
    TensorStore's threads hands its result to the closed loop ("Event loop is closed"), and a
    read's coroutine, collected unfinished, raises its own read error as it is closed. Nobody
    awaits either."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_abandoned_reads", False):
        return

    def hook(unraisable: Any) -> None:
        if not (_is_closed_loop_callback(unraisable) or _is_abandoned_orbax_read(unraisable)):
            previous(unraisable)

    hook.quiets_abandoned_reads = True  # type: ignore[attr-defined]  # a marker on the hook function itself
    sys.unraisablehook = hook
    # A read's Task (or Future) that failed after the loop stopped waiting for it is reported by
    # asyncio's logger when collected ("Task exception was never retrieved"), not through the
    # hook.
    logging.getLogger("asyncio").addFilter(_drop_abandoned_orbax_task)


def quiet_unstarted_reads() -> None:
    """Drop the "coroutine ... was never awaited" warnings of reads that a failed read left
    unstarted; call it where that failure is turned into one line.

    orbax gathers a restore's metadata reads as Tasks on its loop; when the first read fails it
    closes the loop, and reads not yet started then warn as they are collected, at any later
    point or at exit (seen in CI: 'Store._get_array_metadatas', 2026-12-05). The warning
    carries no module to match, and titan-jax runs no coroutines of its own, so after such a
    failure every such warning is the library's."""
    warnings.filterwarnings(
        "ignore", message=r"coroutine '.+' was never awaited", category=RuntimeWarning
    )


# A Future too: a plain one that held a TensorStore read's error printed "Future exception was
# never retrieved" after the one-line error in a suite run under load (2026-12-07).
_NEVER_RETRIEVED = ("Task exception was never retrieved", "Future exception was never retrieved")


def _drop_abandoned_orbax_task(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if not message.startswith(_NEVER_RETRIEVED):
        return True
    if f"{os.sep}orbax{os.sep}" in message:  # one of orbax's coroutines
        return False
    # A TensorStore read error names its spec; seen in CI in a Task whose traceback did not
    # show the future it awaited (2026-12-05).
    if "tensorstore_spec=" in message:
        return False
    # orbax also hands TensorStore's futures to the loop as they are; asyncio wraps each in a
    # Task whose only frame awaits that future.
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        awaited = tb.tb_frame.f_locals.get("awaitable")
        if type(awaited).__module__.startswith("tensorstore"):
            return False
        tb = tb.tb_next
    return True


def _is_closed_loop_callback(unraisable: Any) -> bool:
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (
        unraisable.object is None
        and isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "_check_closed"
        and "asyncio" in tb.tb_frame.f_code.co_filename
    )


def _is_abandoned_orbax_read(unraisable: Any) -> bool:
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine being finalized
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
