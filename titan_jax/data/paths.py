"""Local paths and fsspec URLs (gs://, s3://, memory://, file://) behind one small interface.

Remote files are read by byte range (fsspec's `cat_file(path, start, end)`), never downloaded
whole; a local file is memory-mapped by its reader instead (data/store.py).
"""

from __future__ import annotations

from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

_GLOB = "*?["


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of a local path or URL."""
    return fsspec.core.url_to_fs(url)


def is_local(url: str) -> bool:
    return isinstance(filesystem(url)[0], LocalFileSystem)


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def _url(fs: Any, path: str, like: str) -> str:
    """A path found by `fs` as the user would name it: a URL for a URL, a path for a path."""
    return path if isinstance(fs, LocalFileSystem) and "://" not in like else fs.unstrip_protocol(
        path)


def glob_files(pattern: str, suffixes: tuple[str, ...], error: type[Exception]) -> list[str]:
    """Files named by a file, a folder (searched recursively for `suffixes`) or a glob, sorted."""
    fs, path = filesystem(pattern)
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
