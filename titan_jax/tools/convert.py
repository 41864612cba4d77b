"""`titan-jax convert`: model weights between HF safetensors directories and orbax model
directories (`titan_jax/train/model_io.py`), or HF -> HF to re-type or re-shard."""

from __future__ import annotations

from pathlib import Path

from titan_jax.atomic_dir import DestinationError, check_destination
from titan_jax.config import ConfigError
from titan_jax.models.qwen3 import Qwen3Args
from titan_jax.models.qwen3.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    load_hf_params,
    parse_size,
    save_hf,
)
from titan_jax.models.qwen3.hf_config import read_hf_config
from titan_jax.train.model_io import load_orbax, save_orbax

FORMATS = ("hf", "orbax")


def _check_destination_parents(dst: Path) -> None:
    for parent in dst.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise DestinationError(f"destination {dst} lies under {parent}, which is a file")
            return


def convert(src: str | Path, dst: str | Path, src_format: str, dst_format: str, *,
            dtype: str = "float32", max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
            overwrite: bool = False) -> Qwen3Args:
    """Reads `src` in `src_format` and writes it to `dst` in `dst_format` (hf -> hf re-types or
    re-shards the files). `dtype`/`max_shard_size` apply to HF output. Returns the args.

    `dst` is written whole or not at all; a non-empty `dst` is refused unless `overwrite`, and
    the source is never written (checked before anything is read)."""
    for name, fmt in (("--from", src_format), ("--to", dst_format)):
        if fmt not in FORMATS:
            raise ConfigError(f"{name} {fmt!r}; valid: {', '.join(FORMATS)}")
    if src_format == dst_format == "orbax":
        raise ConfigError("--from orbax --to orbax: nothing to convert")
    try:
        size = parse_size(max_shard_size)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size: {e}") from None
    if size < 1:
        raise ConfigError(f"--max-shard-size {max_shard_size!r} must be at least 1 byte "
                          "(e.g. 5GB)")
    _check_destination_parents(Path(dst))
    check_destination(dst, overwrite=overwrite, source=src)
    if src_format == "hf":
        args = read_hf_config(src)
        params = load_hf_params(src, args)
    else:
        args, params = load_orbax(src)
    if dst_format == "hf":
        save_hf(dst, params, args, dtype=dtype, max_shard_size=max_shard_size,
                overwrite=overwrite, source=src)
    else:
        save_orbax(dst, params, args, overwrite=overwrite, source=src)
    return args
