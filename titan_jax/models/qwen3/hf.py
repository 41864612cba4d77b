"""HF transformers Qwen3 and Qwen3-MoE checkpoints (config.json + safetensors) <-> titan-jax
params, both ways: the Qwen3 state-dict adapter (as torchtitan's is a key map).

What is Qwen3's is the tensor map (`hf_tensors.py`), config.json (`hf_config.py`) and
transformers 5's fused expert tensors; reading and writing safetensors files (sharded files,
slice reads onto shardings, shard sizes, dtypes) is `models/safetensors_io.py`. RoPE needs no
permutation (both sides use the rotate-half layout).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from titan_jax.atomic_dir import atomic_dir
from titan_jax.models import safetensors_io
from titan_jax.models.lora import Lora
from titan_jax.models.qwen3.args import Qwen3Args
from titan_jax.models.qwen3.hf_config import (
    CONFIG_FILE,
    check_args_match,
    hf_config_from_args,
    read_hf_config,
)
from titan_jax.models.qwen3.hf_tensors import (
    IGNORED,
    fused_expert_layout,
    hf_tensors,
    peft_tensors,
)
from titan_jax.models.safetensors_io import DEFAULT_MAX_SHARD_SIZE, HFCheckpointError, Reader

Params = dict[str, Any]

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


class _Reader(Reader):
    """Slice reads that also see transformers 5's in-memory expert layout as the hub's
    per-expert tensors: `mlp.experts.gate_up_proj` (E, 2F, D), gate rows first, and
    `mlp.experts.down_proj` (E, D, F)."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        super().__init__(path, stack)
        self.fused: dict[str, tuple[str, int, int]] = {}  # per-expert name -> (fused, j, row)
        for name in list(self.files):
            prefix, _, fused = name.rpartition(".")
            if not prefix.endswith(".mlp.experts") or fused not in ("gate_up_proj", "down_proj"):
                continue
            experts, rows = self.stored_shape(name)[:2]
            parts = (
                (("gate_proj", 0), ("up_proj", rows // 2))
                if fused == "gate_up_proj"
                else (("down_proj", 0),)
            )
            for j in range(experts):
                for part, first in parts:
                    self.fused[f"{prefix}.{j}.{part}.weight"] = (name, j, first)
                    self.files[f"{prefix}.{j}.{part}.weight"] = self.files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.fused:
            fused, _, _ = self.fused[name]
            _, rows, cols = self.stored_shape(fused)
            return (rows // 2 if fused.endswith("gate_up_proj") else rows, cols)
        return self.stored_shape(name)

    def stored_name(self, name: str) -> str:
        return self.fused[name][0] if name in self.fused else name

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name in self.fused:
            fused, expert, first = self.fused[name]
            rows, cols = index
            rows = slice(first + (rows.start or 0), first + rows.stop)
            return self.open(self.files[fused]).get_slice(fused)[expert, rows, cols]
        return super().read(name, index)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def _check_counts(reader: _Reader, args: Qwen3Args, where: str) -> None:
    """The layer and expert counts the model implies are ones the files hold: the list of
    expected tensors grows with their product, so a tampered count in config.json would
    allocate without bound before any shape is compared."""

    def held(pattern: re.Pattern[str]) -> int:
        return 1 + max(
            (int(m[1]) for name in reader.files if (m := pattern.match(name))), default=-1
        )

    for field, wanted, pattern, what in (
        ("num_hidden_layers", args.n_layers, _LAYER, "layers"),
        ("num_experts", args.num_experts, _EXPERT, "experts"),
    ):
        found = held(pattern)
        if wanted > found:
            raise HFCheckpointError(
                f"{where}: {field}={wanted}, but the safetensors files hold {found} {what}"
            )


def load_hf_params(
    path: str | Path,
    args: Qwen3Args | None = None,
    shardings: Params | None = None,
    dtype: Any = np.float32,
) -> Params:
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
    with contextlib.ExitStack() as stack:
        reader = _Reader(path, stack)
        _check_counts(reader, args, str(path / CONFIG_FILE))
        tensors = hf_tensors(args)
        # HF ties by copying: a tied checkpoint may still store lm_head.weight; it is not used.
        known = {fused for fused, _, _ in reader.fused.values()} | (
            {"lm_head.weight"} if args.tie_embeddings else set()
        )
        model = (
            f"{args.n_layers}-layer {'tied' if args.tie_embeddings else 'untied'} "
            f"{'MoE' if args.is_moe else 'dense'} Qwen3"
        )
        safetensors_io.check_tensors(reader, tensors, known, IGNORED, model)
        return safetensors_io.load_params(reader, tensors, shardings, dtype)


def iter_hf_tensors(
    params: Params, args: Qwen3Args, dtype: Any = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in HF layout) for every tensor, one at a time: at most one layer's
    weights are gathered to the host at once."""
    return safetensors_io.iter_tensors(params, hf_tensors(args), dtype)


def live_hf_tensors(params: Params, args: Qwen3Args) -> dict[str, np.ndarray]:
    """Every tensor under the names a live transformers model's `named_parameters` gives it
    (a MoE layer's experts fused, as transformers 5 holds them in memory)."""
    named = dict(iter_hf_tensors(params, args))
    return fused_expert_layout(named, args) if args.is_moe else named


def save_hf(
    path: str | Path,
    params: Params,
    args: Qwen3Args,
    dtype: str = "float32",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    *,
    overwrite: bool = False,
    source: str | Path | None = None,
) -> list[Path]:
    """Writes `params` as a HF Qwen3 model directory: config.json + safetensors.

    Tied models have no lm_head.weight (as HF saves them). Files larger than `max_shard_size`
    are split into model-0000k-of-0000n.safetensors with a model.safetensors.index.json.
    Every process must call this (gathers are collective); process 0 writes. Returns the files.
    The directory appears whole or not at all (`atomic_dir`): a non-empty `path` is replaced
    only with `overwrite`, and never when it is (or holds, or is inside) `source`.
    """
    np_dtype = safetensors_io.save_dtype(dtype)
    limit = safetensors_io.parse_size(max_shard_size)
    writer = jax.process_index() == 0
    with atomic_dir(path, overwrite=overwrite, source=source, writer=writer) as tmp:
        if writer:
            (tmp / CONFIG_FILE).write_text(
                json.dumps(hf_config_from_args(args, np_dtype.name), indent=2) + "\n"
            )
        names = safetensors_io.write_files(tmp, params, hf_tensors(args), np_dtype, limit, writer)
    return [Path(path) / name for name in [CONFIG_FILE, *names]]


def peft_config(lora: Lora, base_model: str | None) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for `lora` on a Qwen3 causal LM (what PEFT 0.21's
    `LoraConfig.save_pretrained` writes for these settings; PEFT fills any other field with its
    default when it loads the file)."""
    experts = sorted(f"mlp.{p}" for p in lora.projections if p.startswith("experts."))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(p for p in lora.projections if not p.startswith("experts.")),
        "target_parameters": experts or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft(
    path: str | Path,
    params: Params,
    args: Qwen3Args,
    lora: Lora,
    base_model: str | None = None,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    source: str | Path | None = None,
) -> list[Path]:
    """Writes the adapters in `params` as a PEFT LoRA adapter directory (adapter_config.json +
    adapter_model.safetensors), for `PeftModel.from_pretrained` on the HF base model
    (`base_model`, recorded in the config; None when unknown). Every process calls this;
    process 0 writes. Whole or not at all, as `save_hf`."""
    np_dtype = safetensors_io.save_dtype(dtype)
    writer = jax.process_index() == 0
    with atomic_dir(path, overwrite=overwrite, source=source, writer=writer) as tmp:
        # Adapters are small (r x (in + out) per projection): one file, gathered at once.
        tensors = dict(safetensors_io.iter_tensors(params, peft_tensors(args, lora), np_dtype))
        if writer:
            (tmp / PEFT_CONFIG_FILE).write_text(
                json.dumps(peft_config(lora, base_model), indent=2) + "\n"
            )
            save_file(tensors, str(tmp / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    return [Path(path) / PEFT_CONFIG_FILE, Path(path) / PEFT_WEIGHTS_FILE]
