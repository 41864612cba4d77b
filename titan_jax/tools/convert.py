"""`titan-jax convert`: model weights between HF safetensors directories and orbax model
directories (`titan_jax/train/model_io.py`), or HF -> HF to re-type or re-shard; a LoRA run's
checkpoint to PEFT's adapter files (`--to peft`), or merged into one plain model (`--to hf`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from titan_jax.atomic_dir import DestinationError, check_destination, check_names_fit
from titan_jax.config import ConfigError
from titan_jax.data.paths import local_path
from titan_jax.models import get_model_spec
from titan_jax.models.lora import merged
from titan_jax.models.safetensors_io import DEFAULT_MAX_SHARD_SIZE, parse_size
from titan_jax.train.checkpoint import CheckpointError
from titan_jax.train.model_io import (
    NO_ADAPTERS,
    load_orbax,
    orbax_source,
    run_lora,
    save_orbax,
)

SRC_FORMATS = ("hf", "orbax")
DST_FORMATS = ("hf", "orbax", "peft")


def _check_destination_parents(dst: Path) -> None:
    check_names_fit(dst)
    for parent in dst.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise DestinationError(f"destination {dst} lies under {parent}, which is a file")
            return


def convert(
    src: str | Path,
    dst: str | Path,
    src_format: str,
    dst_format: str,
    *,
    dtype: str = "float32",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    model: str = "qwen3",
) -> Any:
    """Reads `src` in `src_format` and writes it to `dst` in `dst_format` (hf -> hf re-types or
    re-shards the files), weights of the registered family `model` (`model.name`). A LoRA
    run's step folder gives its adapters (`peft`) or the model with them merged (`hf`); a
    run's checkpoint folder means its newest step.
    `dtype` applies to HF and PEFT output, `max_shard_size` to HF's. Returns the args.

    `dst` is written whole or not at all; a non-empty `dst` is refused unless `overwrite`, and
    the source is never written (checked before anything is read)."""
    src, dst = local_path(str(src), "SRC"), local_path(str(dst), "DST")
    for name, fmt, valid in (
        ("--from", src_format, SRC_FORMATS),
        ("--to", dst_format, DST_FORMATS),
    ):
        if fmt not in valid:
            raise ConfigError(f"{name} {fmt!r}; valid: {', '.join(valid)}")
    if src_format == dst_format == "orbax":
        raise ConfigError("--from orbax --to orbax: nothing to convert")
    if dst_format == "peft" and src_format != "orbax":
        raise ConfigError(
            "--to peft writes a LoRA run's adapters: give --from orbax and the "
            "run's checkpoint step folder ({dump_folder}/checkpoint/{step})"
        )
    if dst_format == "orbax" and dtype != "float32":  # orbax models keep fp32 masters
        raise ConfigError(
            f"--dtype {dtype} applies to --to hf and peft only; an orbax model "
            "keeps the float32 weights training reads (leave --dtype out)"
        )
    try:
        size = parse_size(max_shard_size)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size: {e}") from None
    if size < 1:
        raise ConfigError(f"--max-shard-size {max_shard_size!r} must be at least 1 byte (e.g. 5GB)")
    if src_format == "orbax":
        src = orbax_source(Path(src))
    _check_destination_parents(Path(dst))
    check_destination(dst, overwrite=overwrite, source=src)
    spec = get_model_spec(model)
    if src_format == "hf":
        args = spec.hf.read_config(src)
        params = spec.hf.load_params(src, args)
        adapters = NO_ADAPTERS
    else:
        adapters = run_lora(src, spec)
        if dst_format == "peft" and not adapters.lora.rank:
            raise CheckpointError(
                f"{src} holds no LoRA adapters (not a step of a run trained "
                "with [lora]); --to peft writes a LoRA run's adapters, "
                "--to hf a whole model"
            )
        args, params = load_orbax(src, spec, lora=adapters.lora)
    if dst_format == "peft":
        spec.hf.save_peft(
            dst,
            params,
            args,
            adapters.lora,
            adapters.base_model,
            dtype=dtype,
            overwrite=overwrite,
            source=src,
        )
        return args
    if adapters.lora.rank:  # the adapted model as one plain model
        params = merged(params, adapters.lora)
    if dst_format == "hf":
        spec.hf.save(
            dst,
            params,
            args,
            dtype=dtype,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            source=src,
        )
    else:
        save_orbax(dst, params, args, overwrite=overwrite, source=src)
    return args
