"""The project's own error type, and how to name the root cause of a wrapped failure.

`TitanJaxError` marks input a person can fix (a config field, a file, a folder): the CLI prints
its message as one line and exits 2. Anything else (a bug, an error from JAX or orbax) keeps its
traceback and exits 1, so real failures are never disguised as bad input.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

# Failures of the machine rather than of titan-jax: named first when a save or write fails.
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
                       errno.EIO)


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


def quiet_closed_loop_callbacks() -> None:
    """Drop the "Event loop is closed" tracebacks that follow a failed orbax read; every other
    unraisable error is reported as before. Installed once for the process.

    orbax runs a restore's TensorStore reads on a fresh asyncio loop and closes it when the first
    read fails. Reads still in flight then finish on TensorStore's threads and hand their results
    to the closed loop (`call_soon_threadsafe`), whose RuntimeError reaches `sys.unraisablehook`:
    one traceback per read, around the one-line error that says what is wrong. Nobody awaits
    those results."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_closed_loops", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    hook.quiets_closed_loops = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _is_closed_loop_callback(unraisable: Any) -> bool:
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed" and tb is not None
            and tb.tb_frame.f_code.co_name == "_check_closed"
            and "asyncio" in tb.tb_frame.f_code.co_filename)
