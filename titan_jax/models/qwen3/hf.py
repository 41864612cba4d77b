"""HF transformers Qwen3 and Qwen3-MoE checkpoints (config.json + safetensors) <-> titan-jax
params, both ways.

The name and layout map is in `hf_tensors.py`; RoPE needs no permutation (both sides use the
rotate-half layout). Loading places every tensor straight onto its target sharding with
`jax.make_array_from_callback`; each callback reads only its shard's slice from the files, so no
host ever holds a whole tensor it does not own, let alone the whole model. Saving gathers one
HF tensor at a time (an expert stack once per layer) and writes one safetensors file at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from titan_jax.atomic_dir import atomic_dir
from titan_jax.models.qwen3.args import Qwen3Args
from titan_jax.models.qwen3.hf_config import (
    CONFIG_FILE,
    HFCheckpointError,
    check_args_match,
    hf_config_from_args,
    read_hf_config,
)
from titan_jax.models.qwen3.hf_tensors import IGNORED, HFTensor, hf_tensors, to_hf_layout
from titan_jax.trees import nested_get, nested_set

Params = dict[str, Any]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # HF's default "5GB"


# ------------------------------------------------------------------------------------------------
# Loading


class _Reader:
    """Lazy slice reads from a HF model directory's safetensors file(s)."""

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
            self.files = {name: single for name in self._open(single).keys()}
        else:
            raise HFCheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")
        self.fused = self._fused_experts()

    def _fused_experts(self) -> dict[str, tuple[str, int, int]]:
        """Per-expert names -> (fused tensor, expert, first row) for files in transformers 5's
        in-memory layout: `mlp.experts.gate_up_proj` (E, 2F, D), gate rows first, and
        `mlp.experts.down_proj` (E, D, F). Reads then see the hub's per-expert tensors."""
        virtual = {}
        for name in list(self.files):
            prefix, _, fused = name.rpartition(".")
            if not prefix.endswith(".mlp.experts") or fused not in ("gate_up_proj", "down_proj"):
                continue
            experts, rows = self._open(self.files[name]).get_slice(name).get_shape()[:2]
            parts = (("gate_proj", 0), ("up_proj", rows // 2)) if fused == "gate_up_proj" \
                else (("down_proj", 0),)
            for j in range(experts):
                for part, first in parts:
                    virtual[f"{prefix}.{j}.{part}.weight"] = (name, j, first)
                    self.files[f"{prefix}.{j}.{part}.weight"] = self.files[name]
        return virtual

    def _open(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = self._stack.enter_context(
                    safe_open(str(file), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise HFCheckpointError(f"{file}: cannot read safetensors file: {e}") from None
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.fused:
            fused, _, _ = self.fused[name]
            _, rows, cols = self._open(self.files[fused]).get_slice(fused).get_shape()
            return (rows // 2 if fused.endswith("gate_up_proj") else rows, cols)
        return tuple(self._open(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name in self.fused:
            fused, expert, first = self.fused[name]
            rows, cols = index
            rows = slice(first + (rows.start or 0), first + rows.stop)
            return self._open(self.files[fused]).get_slice(fused)[expert, rows, cols]
        return self._open(self.files[name]).get_slice(name)[index]


def _check_tensors(reader: _Reader, tensors: list[HFTensor], args: Qwen3Args) -> None:
    """Every expected tensor is there with its shape, and nothing unknown is."""
    for t in tensors:
        if t.name not in reader.files:
            raise HFCheckpointError(f"{reader.path}: missing tensor {t.name!r}")
        shape = reader.shape(t.name)
        if shape != t.hf_shape:
            raise HFCheckpointError(
                f"{reader.files[t.name]}: tensor {t.name!r} has shape {shape}, expected "
                f"{t.hf_shape} from config.json"
            )
    known = {t.name for t in tensors} | {fused for fused, _, _ in reader.fused.values()}
    # HF ties by copying: a tied checkpoint may still store lm_head.weight; it is not used.
    if args.tie_embeddings:
        known.add("lm_head.weight")
    unknown = sorted(n for n in reader.files if n not in known and not IGNORED.fullmatch(n))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise HFCheckpointError(
            f"{reader.path}: unexpected tensors {unknown[:5]}{more} for a {args.n_layers}-layer "
            f"{'tied' if args.tie_embeddings else 'untied'} "
            f"{'MoE' if args.is_moe else 'dense'} Qwen3 config.json"
        )


def _slice_bounds(s: slice, size: int) -> tuple[int, int]:
    start, stop, step = s.indices(size)
    if step != 1:
        raise ValueError(f"strided shard index {s} is not supported")
    return start, stop


def _read_shard(reader: _Reader, t: HFTensor, index: tuple[slice, ...]) -> np.ndarray:
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


def _read_stacked(reader: _Reader, group: list[HFTensor], stack: tuple[int, ...],
                  bounds: tuple[tuple[int, int], ...], index: tuple[slice, ...]) -> np.ndarray:
    """The block of a stacked weight covering `bounds` on its stacked axes: one HF tensor per
    stacked position (`group` in row-major order over `stack`)."""
    if not stack:
        return _read_shard(reader, group[0], index)
    (first, last), inner = bounds[0], math.prod(stack[1:])
    return np.stack([_read_stacked(reader, group[i * inner:(i + 1) * inner], stack[1:],
                                   bounds[1:], index) for i in range(first, last)])


def load_hf_params(path: str | Path, args: Qwen3Args | None = None,
                   shardings: Params | None = None, dtype: Any = np.float32) -> Params:
    """Reads the HF model directory `path` into titan-jax params.

    args: the model to load into; checked against the checkpoint's config.json (None: use it).
    shardings: a params-shaped tree of `jax.sharding.Sharding`; each array is created on its
      sharding, every device's shard read straight from the files. None: the default device.
    dtype: the params' dtype (fp32 master weights; bf16 files are widened exactly).
    """
    path = Path(path)
    checkpoint = read_hf_config(path)
    if args is None:
        args = checkpoint
    else:
        check_args_match(args, checkpoint, str(path / CONFIG_FILE))
    tensors = hf_tensors(args)
    by_path: dict[tuple[str, ...], list[HFTensor]] = {}
    for t in tensors:
        by_path.setdefault(t.path, []).append(t)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    params: Params = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(path, stack)
        _check_tensors(reader, tensors, args)
        for tpath, group in by_path.items():
            sharding = default if shardings is None else nested_get(shardings, tpath)
            # Leading stacked axes: layers, then experts (tensors come layer-major).
            stack = (args.n_layers,) * (group[0].layer is not None) + (
                args.num_experts,) * (group[0].expert is not None)
            shape = (*stack, *group[0].shape)
            cache: dict[tuple, np.ndarray] = {}  # replicated shards are read once

            def callback(index: tuple[slice, ...], group: list[HFTensor] = group,
                         stack: tuple[int, ...] = stack, shape: tuple[int, ...] = shape,
                         cache: dict = cache) -> np.ndarray:
                index = tuple(index) + (slice(None),) * (len(shape) - len(index))
                key = tuple(_slice_bounds(s, n) for s, n in zip(index, shape, strict=True))
                if key not in cache:
                    cache[key] = _read_stacked(reader, group, stack, key,
                                               index[len(stack):]).astype(dtype)
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
_take_layer = jax.jit(lambda layers, i: jax.tree.map(
    lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), layers))


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
    if all(x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())
           for x in leaves):
        return jax.tree.map(lambda x: _host_layer(x, i), layers)
    return _take_layer(layers, i)


def iter_hf_tensors(params: Params, args: Qwen3Args, dtype: Any = None
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in HF layout) for every tensor, one at a time: at most one layer's
    weights are gathered to the host at once."""
    current, layer, host = None, None, {}
    for t in hf_tensors(args):
        if t.layer is None:
            leaf = _host_array(nested_get(params, t.path))
        else:
            if t.layer != current:
                current, layer, host = t.layer, _layer(params["layers"], t.layer), {}
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
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def save_hf(path: str | Path, params: Params, args: Qwen3Args, dtype: str = "float32",
            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, *, overwrite: bool = False,
            source: str | Path | None = None) -> list[Path]:
    """Writes `params` as a HF Qwen3 model directory: config.json + safetensors.

    Tied models have no lm_head.weight (as HF saves them). Files larger than `max_shard_size`
    are split into model-0000k-of-0000n.safetensors with a model.safetensors.index.json.
    Every process must call this (gathers are collective); process 0 writes. Returns the files.
    The directory appears whole or not at all (`atomic_dir`): a non-empty `path` is replaced
    only with `overwrite`, and never when it is (or holds, or is inside) `source`.
    """
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(SAVE_DTYPES)}")
    np_dtype, limit = SAVE_DTYPES[dtype], parse_size(max_shard_size)
    writer = jax.process_index() == 0
    with atomic_dir(path, overwrite=overwrite, source=source, writer=writer) as tmp:
        names = _write_hf(tmp, params, args, np_dtype, limit, writer)
    return [Path(path) / name for name in names]


def _write_hf(path: Path, params: Params, args: Qwen3Args, np_dtype: np.dtype, limit: int,
              writer: bool) -> list[str]:
    """save_hf's files, written into `path`; returns their names."""
    tensors = hf_tensors(args)
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
    names = [SINGLE_FILE] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors"
                                           for k in range(1, n + 1)]
    if writer:
        (path / CONFIG_FILE).write_text(
            json.dumps(hf_config_from_args(args, np_dtype.name), indent=2) + "\n")
    values = iter_hf_tensors(params, args, np_dtype)
    for file, shard in zip(names, shards, strict=True):
        data = dict(next(values) for _ in shard)
        if writer:
            save_file(data, str(path / file), metadata={"format": "pt"})
    if writer and n > 1:
        weight_map = {name: file for file, shard in zip(names, shards, strict=True)
                      for name in shard}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [CONFIG_FILE, *names] + ([INDEX_FILE] if n > 1 else [])
