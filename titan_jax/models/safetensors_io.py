"""Safetensors model directories <-> params trees, for any family with a tensor map.

A family describes its checkpoint as a list of `HFTensor`s (each HF tensor's name, where it
lives in the params tree, its titan-jax shape and layout); everything else is here and knows no
model: a single `model.safetensors` or sharded files with a `model.safetensors.index.json`,
lazy slice reads, `max_shard_size`, the saved dtype, and gathers that never hold more than one
layer's weights on a host.

Loading places every tensor straight onto its target sharding with
`jax.make_array_from_callback`; each callback reads only its shard's slice from the files, so no
host ever holds a whole tensor it does not own, let alone the whole model. Saving gathers one
HF tensor at a time (an expert stack once per layer) and writes one safetensors file at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from titan_jax.errors import TitanJaxError
from titan_jax.trees import nested_get, nested_set

Params = dict[str, Any]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # HF's default "5GB"
# The header dtypes a weight loads from (widened or narrowed to the params' dtype). An integer
# or bool tensor would be cast to floats silently; fp8 the numpy reader cannot decode.
WEIGHT_DTYPES = ("F32", "F16", "BF16", "F64")


class HFCheckpointError(TitanJaxError, ValueError):
    """A HF checkpoint directory that cannot be read: the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One HF tensor and where it lives in titan-jax params.

    `path`: key path into params; `layer`: index on the stacked layers axis (None outside layers);
    `shape`: the titan-jax shape (per layer); `n_in`: for linear weights, how many leading titan
    dims form the input side (HF stores the transpose, flattened to (out, in)); None = same layout.
    `hf_dims`: for a layout of its own (written only: PEFT's fused-expert adapters), each HF dim
    as the titan dims merged into it, in order (n_in's is ((n_in, ...), (0, ..., n_in - 1))).
    """

    name: str
    path: tuple[str, ...]
    layer: int | None
    shape: tuple[int, ...]
    n_in: int | None
    expert: int | None = None  # index on the stacked experts axis (after the layers axis)
    hf_dims: tuple[tuple[int, ...], ...] | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.hf_dims is not None:
            return tuple(math.prod(self.shape[d] for d in dims) for dims in self.hf_dims)
        if self.n_in is None:
            return self.shape
        return (math.prod(self.shape[self.n_in :]), math.prod(self.shape[: self.n_in]))


def to_hf_layout(t: HFTensor, x: np.ndarray) -> np.ndarray:
    """A titan-jax (per-layer) array in HF layout."""
    if t.hf_dims is not None:
        return x.transpose([d for dims in t.hf_dims for d in dims]).reshape(t.hf_shape)
    if t.n_in is None:
        return x
    n_in = math.prod(t.shape[: t.n_in])
    return x.reshape(n_in, -1).T


# ------------------------------------------------------------------------------------------------
# Loading


class Reader:
    """Lazy slice reads from a model directory's safetensors file(s). `files` maps every tensor
    name to its file; a family may add names that read out of another tensor (`views`)."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        self.path, self._stack = path, stack
        self._handles: dict[Path, Any] = {}
        index, single = path / INDEX_FILE, path / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {name: path / file for name, file in weight_map.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise HFCheckpointError(f"{index}: not a safetensors index ({e!r})") from None
            for file in sorted(set(self.files.values())):
                if not file.is_file():
                    raise HFCheckpointError(f"{index} lists {file.name}, which does not exist")
        elif single.is_file():
            self.files = {name: single for name in self.open(single).keys()}
        else:
            raise HFCheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")

    def open(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = self._stack.enter_context(
                    safe_open(str(file), framework="numpy")
                )
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise HFCheckpointError(f"{file}: cannot read safetensors file: {e}") from None
        return self._handles[file]

    def stored_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.open(self.files[name]).get_slice(name).get_shape())

    def shape(self, name: str) -> tuple[int, ...]:
        return self.stored_shape(name)

    def stored_name(self, name: str) -> str:
        """The tensor in the files that `name` is read from (itself, or what a view reads)."""
        return name

    def stored_dtype(self, name: str) -> str:
        """The dtype the file's header declares for `name` ("F32", "BF16", "I32", ...)."""
        return self.open(self.files[name]).get_slice(name).get_dtype()

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.open(self.files[name]).get_slice(name)[index]


def check_tensors(
    reader: Reader,
    tensors: list[HFTensor],
    known: Iterable[str],
    ignored: re.Pattern[str],
    model: str,
) -> None:
    """Every expected tensor is there with its shape, and nothing unknown is (`known`: names
    that may be stored but are not loaded; `model` describes the config.json for the error)."""
    for t in tensors:
        if t.name not in reader.files:
            raise HFCheckpointError(f"{reader.path}: missing tensor {t.name!r}")
        shape = reader.shape(t.name)
        if shape != t.hf_shape:
            raise HFCheckpointError(
                f"{reader.files[t.name]}: tensor {t.name!r} has shape {shape}, expected "
                f"{t.hf_shape} from config.json"
            )
        stored = reader.stored_name(t.name)
        dtype = reader.stored_dtype(stored)
        if dtype not in WEIGHT_DTYPES:
            raise HFCheckpointError(
                f"{reader.files[stored]}: tensor {stored!r} has dtype {dtype}; a weight loads "
                f"from a floating-point tensor of dtype {', '.join(WEIGHT_DTYPES)}"
            )
    known = {t.name for t in tensors} | set(known)
    unknown = sorted(n for n in reader.files if n not in known and not ignored.fullmatch(n))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise HFCheckpointError(
            f"{reader.path}: unexpected tensors {unknown[:5]}{more} for a {model} config.json"
        )


def _slice_bounds(s: slice, size: int) -> tuple[int, int]:
    start, stop, step = s.indices(size)
    if step != 1:
        raise ValueError(f"strided shard index {s} is not supported")
    return start, stop


def _read_shard(reader: Reader, t: HFTensor, index: tuple[slice, ...]) -> np.ndarray:
    """The `index` slice of tensor `t` in titan-jax layout, reading only the rows/cols it covers.

    For a linear weight, the titan dims split into an input group and an output group, each
    flattened into one HF dim; a group's slice is read as the contiguous HF range covering its
    first dim's slice (whole trailing dims), then the trailing dims are sliced in memory. Only a
    sharded trailing dim (e.g. head_dim) reads more than the shard needs.
    """
    bounds = [_slice_bounds(s, n) for s, n in zip(index, t.shape, strict=True)]
    if t.n_in is None:
        return reader.read(t.name, tuple(slice(a, b) for a, b in bounds))

    def group(dims: range) -> tuple[slice, tuple[int, ...], tuple[slice, ...]]:
        trailing = math.prod(t.shape[d] for d in dims[1:])
        a, b = bounds[dims[0]]
        shape = (b - a, *(t.shape[d] for d in dims[1:]))
        rest = (slice(None), *(slice(*bounds[d]) for d in dims[1:]))
        return slice(a * trailing, b * trailing), shape, rest

    in_rows, in_shape, in_rest = group(range(0, t.n_in))
    out_rows, out_shape, out_rest = group(range(t.n_in, len(t.shape)))
    hf = reader.read(t.name, (out_rows, in_rows))  # (out, in)
    x = hf.T.reshape(*in_shape, *out_shape)
    return x[(*in_rest, *out_rest)]


def _read_stacked(
    reader: Reader,
    group: list[HFTensor],
    stack: tuple[int, ...],
    bounds: tuple[tuple[int, int], ...],
    index: tuple[slice, ...],
) -> np.ndarray:
    """The block of a stacked weight covering `bounds` on its stacked axes: one HF tensor per
    stacked position (`group` in row-major order over `stack`)."""
    if not stack:
        return _read_shard(reader, group[0], index)
    (first, last), inner = bounds[0], math.prod(stack[1:])
    return np.stack(
        [
            _read_stacked(reader, group[i * inner : (i + 1) * inner], stack[1:], bounds[1:], index)
            for i in range(first, last)
        ]
    )


def _stack_of(group: list[HFTensor]) -> tuple[int, ...]:
    """A params leaf's leading stacked axes (layers, then experts), from its HF tensors."""
    layers = len({t.layer for t in group}) if group[0].layer is not None else None
    experts = len({t.expert for t in group}) if group[0].expert is not None else None
    return tuple(n for n in (layers, experts) if n is not None)


def load_params(
    reader: Reader,
    tensors: list[HFTensor],
    shardings: Params | None = None,
    dtype: Any = np.float32,
) -> Params:
    """The params tree of `tensors` (checked first with `check_tensors`), each leaf created on
    its sharding in `shardings` (None: the default device), every device's shard read straight
    from the files; `dtype`: the params' dtype (bf16 files are widened exactly)."""
    by_path: dict[tuple[str, ...], list[HFTensor]] = {}
    for t in tensors:  # tensors come layer-major, so a group is row-major over its stack
        by_path.setdefault(t.path, []).append(t)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: Params = {}
    for tpath, group in by_path.items():
        sharding = default if shardings is None else nested_get(shardings, tpath)
        stack = _stack_of(group)
        shape = (*stack, *group[0].shape)
        cache: dict[tuple, np.ndarray] = {}  # replicated shards are read once

        def callback(
            index: tuple[slice, ...] | None,
            group: list[HFTensor] = group,
            stack: tuple[int, ...] = stack,
            shape: tuple[int, ...] = shape,
            cache: dict = cache,
        ) -> np.ndarray:
            index = tuple(index or ())  # None (jax never passes it): the whole array
            index += (slice(None),) * (len(shape) - len(index))
            key = tuple(_slice_bounds(s, n) for s, n in zip(index, shape, strict=True))
            if key not in cache:
                cache[key] = _read_stacked(reader, group, stack, key, index[len(stack) :]).astype(
                    dtype
                )
            return cache[key]

        nested_set(params, tpath, jax.make_array_from_callback(shape, sharding, callback))
    return params


# ------------------------------------------------------------------------------------------------
# Saving


def _host_array(x: Any) -> np.ndarray:
    """The full value of `x` on this host (an all-gather when it spans other processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


# Layer i of every stacked leaf in one compiled program (i traced: one compile per model). For
# arrays on accelerators or spread over processes, whose layer axis is never sharded (rules.py).
_take_layer = jax.jit(
    lambda layers, i: jax.tree.map(
        lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), layers
    )
)


def _host_layer(x: jax.Array, i: int) -> np.ndarray:
    """Layer i of a stacked array whose shards all sit in this host's memory (CPU devices),
    copied out of the shards that hold it: no compile, any sharding."""
    out = np.empty(x.shape[1:], x.dtype)
    for shard in x.addressable_shards:
        start, stop, _ = shard.index[0].indices(x.shape[0])
        if start <= i < stop:
            out[shard.index[1:]] = np.asarray(shard.data)[i - start]
    return out


def _layer(layers: Params, i: int) -> Params:
    leaves = jax.tree.leaves(layers)
    if not any(isinstance(x, jax.Array) for x in leaves):
        return jax.tree.map(lambda x: x[i], layers)  # host arrays
    if all(
        x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices()) for x in leaves
    ):
        return jax.tree.map(lambda x: _host_layer(x, i), layers)
    return _take_layer(layers, i)


def iter_tensors(
    params: Params, tensors: list[HFTensor], dtype: Any = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in HF layout) for every tensor, one at a time: at most one layer's
    weights are gathered to the host at once (stacked leaves live under params["layers"])."""
    current, host = None, {}
    layer: Params = {}  # the current layer's weights, taken when its first tensor comes
    for t in tensors:
        if t.layer is None:
            leaf = _host_array(nested_get(params, t.path))
        else:
            if t.layer != current:
                current, layer, host = t.layer, _layer(params[t.path[0]], t.layer), {}
            if t.path not in host:  # an expert stack is copied once for all its experts
                host[t.path] = _host_array(nested_get(layer, t.path[1:]))
            leaf = host[t.path] if t.expert is None else host[t.path][t.expert]
        x = np.ascontiguousarray(to_hf_layout(t, leaf))
        yield t.name, x if dtype is None else x.astype(dtype)


def parse_size(text: str | int) -> int:
    """Bytes from an int or a size such as "5GB" (10^9) or "2GiB" (2^30)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} is not a number of bytes or like 5GB / 500MiB")
    unit = (m.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    return int(float(m.group(1)) * scale)


def save_dtype(dtype: str) -> np.dtype:
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(SAVE_DTYPES)}")
    return SAVE_DTYPES[dtype]


def write_files(
    path: Path,
    params: Params,
    tensors: list[HFTensor],
    np_dtype: np.dtype,
    limit: int,
    writer: bool,
) -> list[str]:
    """The safetensors files of `params` written into `path` (only where `writer`; every
    process gathers): one file, or files of at most `limit` bytes each (a tensor larger than
    `limit` has a file of its own) and the index. Returns the names written."""
    # Plan the files from shapes alone, so names and the index are known before any gather.
    shards: list[list[str]] = [[]]
    size = 0
    sizes = {t.name: math.prod(t.hf_shape) * np_dtype.itemsize for t in tensors}
    for t in tensors:
        if shards[-1] and size + sizes[t.name] > limit:
            shards.append([])
            size = 0
        shards[-1].append(t.name)
        size += sizes[t.name]
    n = len(shards)
    names = (
        [SINGLE_FILE]
        if n == 1
        else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    )
    values = iter_tensors(params, tensors, np_dtype)
    for file, shard in zip(names, shards, strict=True):
        data = dict(next(values) for _ in shard)
        if writer:
            save_file(data, str(path / file), metadata={"format": "pt"})
    if writer and n > 1:
        weight_map = {
            name: file for file, shard in zip(names, shards, strict=True) for name in shard
        }
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names + ([INDEX_FILE] if n > 1 else [])
