"""Local paths and fsspec URLs (gs://, s3://, memory://, file://) behind one small interface.

Remote files are read by byte range (fsspec's `cat_file(path, start, end)`), never downloaded
whole; a local file is memory-mapped by its reader instead (data/store.py).

The URLs taken: gs:// (gcsfs, in the tpu extra), s3:// (with s3fs installed), http(s):// (to
read), memory:// and file://. Any other scheme, or one whose package is missing, is refused at
once in one line: fsspec would otherwise try it (pyarrow's hdfs looks for a JVM) or fail deep
in a traceback. Fields that take local paths only (`local_path`) refuse every URL but file://,
rather than make a local folder named "gs:".

A gs:// URL on a machine that cannot resolve Cloud Storage's host is refused at once too:
gcsfs would retry for a minute or more and end in tracebacks (or, for a read, in "no such
file").
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from titan_jax.errors import TitanJaxError

_GLOB = "*?["
# fsspec protocols titan-jax reads and writes through; None is a local path.
SCHEMES = (None, "file", "local", "memory", "gs", "gcs", "s3", "s3a", "http", "https")
WHAT_WORKS = "local paths, file://, gs:// (and s3:// with s3fs installed; http(s):// to read)"
GCS_HOST = "storage.googleapis.com"


class PathError(TitanJaxError, ValueError):
    """A path or URL that cannot be used: the message names it and what would work."""


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of a local path or URL of `SCHEMES`."""
    scheme = fsspec.core.split_protocol(url)[0]
    if scheme not in SCHEMES:
        raise PathError(f"{url}: {scheme}:// is not supported; titan-jax takes {WHAT_WORKS}")
    if scheme in ("gs", "gcs") and (why := cloud_storage_unreachable()) is not None:
        raise PathError(
            f"{url}: Cloud Storage ({GCS_HOST}) cannot be reached from this machine "
            f"({why}); use a local path, or run where the bucket can be reached"
        )
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # the scheme's package is not installed: fsspec says which
        raise PathError(f"{url}: {scheme}:// needs a package that is not installed ({e})") from None


@functools.cache
def cloud_storage_unreachable() -> str | None:
    """Why this machine cannot resolve Cloud Storage's host, or None; asked once a process (a
    GCS emulator, `STORAGE_EMULATOR_HOST`, is taken as reachable)."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return None
    try:
        socket.getaddrinfo(GCS_HOST, 443)
    except OSError as e:
        return e.strerror or str(e)
    return None


def local_path(value: str, field: str) -> Path:
    """`value` of a field that takes a local path: a file:// URL is the path it names; another
    URL is refused (it would be read as a folder named after its scheme)."""
    scheme, path = fsspec.core.split_protocol(value)
    if scheme in (None, "file", "local"):
        return Path(path)
    raise PathError(
        f"{field} {value}: a URL, and {field} takes a local path; copy it to a "
        "local folder first and give that folder"
    )


def is_local(url: str) -> bool:
    return isinstance(filesystem(url)[0], LocalFileSystem)


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def _url(fs: Any, path: str, like: str) -> str:
    """A path found by `fs` as the user would name it: a URL for a URL, a path for a path."""
    return (
        path if isinstance(fs, LocalFileSystem) and "://" not in like else fs.unstrip_protocol(path)
    )


def glob_files(pattern: str, suffixes: tuple[str, ...], error: type[Exception]) -> list[str]:
    """Files named by a file, a folder (searched recursively for `suffixes`) or a glob, sorted."""
    fs, path = filesystem(pattern)
    try:
        if any(c in pattern for c in _GLOB):
            found = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            found = [p for p in fs.find(path) if p.endswith(suffixes)]
        elif fs.isfile(path):
            found = [path]
        elif fs.exists(path):
            raise error(f"dataset_path={pattern!r} is neither a regular file nor a folder")
        else:
            raise error(f"dataset_path={pattern!r} does not exist")
    except OSError as e:  # a host that does not answer, a bucket this user may not list
        raise error(f"dataset_path={pattern!r} cannot be read: {e.strerror or e}") from None
    if not found:
        raise error(f"dataset_path={pattern!r} matches no {'/'.join(suffixes)} files")
    return [_url(fs, p, pattern) for p in sorted(found)]


def glob_dirs(spec: str) -> list[str]:
    """Folders named by a comma-separated list whose items may be globs, in the order given
    (each glob's matches sorted)."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if any(c in item for c in _GLOB):
            fs, path = filesystem(item)
            out.extend(_url(fs, p, item) for p in sorted(fs.glob(path)) if fs.isdir(p))
        else:
            out.append(item)
    return out
