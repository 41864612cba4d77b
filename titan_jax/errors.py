"""The project's own error type, and how to name the root cause of a wrapped failure.

`TitanJaxError` marks input a person can fix (a config field, a file, a folder): the CLI prints
its message as one line and exits 2. Anything else (a bug, an error from JAX or orbax) keeps its
traceback and exits 1, so real failures are never disguised as bad input.
"""

from __future__ import annotations

import errno
import os

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
