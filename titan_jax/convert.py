"""`titan-jax convert`: model weights between HF safetensors directories and orbax checkpoints.

The orbax side written is a model-only checkpoint directory:

    DST/model_args.json   the Qwen3Args fields (what `build_model_def` needs)
    DST/params/           orbax `StandardCheckpointer` of the params pytree: fp32, titan-jax
                          layout and names, layers stacked (params["layers"]["attention"]["wq"])

Read are that, or one step folder of a training run (`{dump_folder}/checkpoint/{step}`, its
params only). Restores go straight onto target shardings (orbax reads each device's slice).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from titan_jax.models.qwen3 import Qwen3Args, build_model_def
from titan_jax.models.qwen3.build import Params
from titan_jax.models.qwen3.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    load_hf_params,
    read_hf_config,
    save_hf,
)

FORMATS = ("hf", "orbax")
ARGS_FILE = "model_args.json"
PARAMS_DIR = "params"


def save_orbax(path: str | Path, params: Params, args: Qwen3Args) -> None:
    """Writes the model-only orbax checkpoint described in the module docstring."""
    path = Path(path).resolve()
    if (path / PARAMS_DIR).exists():
        raise FileExistsError(f"{path / PARAMS_DIR} already exists; choose a new destination")
    path.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (path / ARGS_FILE).write_text(json.dumps(dataclasses.asdict(args), indent=2) + "\n")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / PARAMS_DIR, params)
    checkpointer.wait_until_finished()


def read_orbax_args(path: str | Path) -> Qwen3Args:
    file = Path(path) / ARGS_FILE
    try:
        fields = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no {ARGS_FILE} (not a titan-jax orbax model directory)"
                         ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON: {e}") from None
    known = {f.name for f in dataclasses.fields(Qwen3Args)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{file}: unknown fields {unknown}; valid: {', '.join(sorted(known))}")
    return Qwen3Args(**fields)


def _abstract_params(args: Qwen3Args, shardings: Params | None) -> Params:
    abstract = build_model_def(args).abstract_params
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: default, abstract) if shardings is None else shardings
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        abstract, shardings)


def is_training_checkpoint(path: str | Path) -> bool:
    """A step folder of a training run (`{dump_folder}/checkpoint/{step}`)."""
    path = Path(path)
    return path.name.isdigit() and (path / "meta").is_dir() and (path / "state").is_dir()


def load_orbax(path: str | Path, shardings: Params | None = None) -> tuple[Qwen3Args, Params]:
    """(args, params) of a model-only orbax checkpoint, or of one step of a training run's
    checkpoints (its params only), restored onto `shardings` (None: the default device)."""
    path = Path(path).resolve()
    if is_training_checkpoint(path):
        from titan_jax.train.checkpoint import Checkpointer

        with Checkpointer(path.parent, read_only=True) as ckpt:
            step = int(path.name)
            args = Qwen3Args(**ckpt.meta(step)["model_args"])
            target = {"params": _abstract_params(args, shardings)}
            return args, ckpt.restore(step, target, model_only=True).state["params"]
    args = read_orbax_args(path)
    target = _abstract_params(args, shardings)
    return args, ocp.StandardCheckpointer().restore(path / PARAMS_DIR, target)


def convert(src: str | Path, dst: str | Path, src_format: str, dst_format: str, *,
            dtype: str = "float32", max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
            ) -> Qwen3Args:
    """Reads `src` in `src_format` and writes it to `dst` in `dst_format` (hf -> hf re-types or
    re-shards the files). `dtype`/`max_shard_size` apply to HF output. Returns the args."""
    for name, fmt in (("--from", src_format), ("--to", dst_format)):
        if fmt not in FORMATS:
            raise ValueError(f"{name} {fmt!r}; valid: {', '.join(FORMATS)}")
    if src_format == dst_format == "orbax":
        raise ValueError("--from orbax --to orbax: nothing to convert")
    if src_format == "hf":
        args = read_hf_config(src)
        params = load_hf_params(src, args)
    else:
        args, params = load_orbax(src)
    if dst_format == "hf":
        save_hf(dst, params, args, dtype=dtype, max_shard_size=max_shard_size)
    else:
        save_orbax(dst, params, args)
    return args
