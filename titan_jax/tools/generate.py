"""`titan-jax generate`: text from a trained checkpoint (a LoRA run's with its adapters merged
into the weights) or a HF directory of the recipe's `model.name`.

Weights are loaded straight onto the shardings the recipe's mesh gives them in training
(`[parallelism]`, `job.cpu_devices`), and decoding (the family's `ModelSpec.generate`; Qwen3's
is `models/qwen3/decode.py`: KV cache, jitted prefill and per-token step) runs on that mesh, in
`training.mixed_precision_param`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from titan_jax.config import JobConfig
from titan_jax.config import Lora as LoraSection
from titan_jax.data.paths import local_path
from titan_jax.data.tokenizer import Tokenizer, load_tokenizer
from titan_jax.errors import TitanJaxError
from titan_jax.models import ModelArgs, ModelSpec, get_model_spec
from titan_jax.models.lora import merged
from titan_jax.models.spec import Params
from titan_jax.train.checkpoint import Checkpointer, is_checkpoint_dir
from titan_jax.train.model_io import (
    ARGS_FILE,
    NO_ADAPTERS,
    checkpoint_args,
    load_orbax,
    orbax_source,
    read_orbax_args,
    run_lora,
)
from titan_jax.train.run_plan import resolve_param_dtype
from titan_jax.train.trainer import build_trainer


class GenerateError(TitanJaxError, ValueError):
    """Bad `titan-jax generate` input: the message names the flag or path."""


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    prompt: str
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens {self.max_new_tokens} must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GenerateError(
                f"--temperature {self.temperature} must be a number >= 0 (0 = greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"--top-p {self.top_p} must be in (0, 1]")
        if self.top_p < 1 and self.temperature == 0:  # greedy decoding never samples
            raise GenerateError(
                f"--top-p {self.top_p} needs --temperature > 0 (it is 0: greedy "
                "decoding, which --top-p would not change); add e.g. "
                "--temperature 0.7, or leave --top-p out"
            )
        if not 0 <= self.seed < 2**31:
            raise GenerateError(f"--seed {self.seed} must be in [0, 2**31)")
        try:
            self.prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # undecodable bytes in argv arrive as lone surrogates
            raise GenerateError(
                f"--prompt is not UTF-8 text (character {e.start}); pass the prompt in UTF-8"
            ) from None


def resolve_checkpoint(path: str | Path) -> Path:
    """A run's checkpoint folder means its newest step; a step folder or an orbax model
    directory (`titan-jax convert --to orbax`) is taken as given."""
    path = Path(path)
    if not path.exists():
        raise GenerateError(f"--checkpoint {path} does not exist")
    if not path.is_dir():
        raise GenerateError(
            f"--checkpoint {path} is a file; give a run's checkpoint folder, "
            "one of its step folders, or an orbax model directory"
        )
    source = orbax_source(path)
    if not is_checkpoint_dir(source) and not (source / ARGS_FILE).is_file():
        raise GenerateError(
            f"--checkpoint {path} is neither a checkpoint step folder, a folder of "
            "them, nor an orbax model directory (model_args.json + params/)"
        )
    return source


def _orbax_args(path: Path, spec: ModelSpec) -> Any:
    if is_checkpoint_dir(path):
        with Checkpointer(path.parent, read_only=True) as ckpt:
            return checkpoint_args(ckpt, int(path.name), spec)
    return read_orbax_args(path, spec)


def _source(checkpoint: str | None, hf_checkpoint: str | None, spec: ModelSpec) -> tuple[Path, Any]:
    if hf_checkpoint is not None and checkpoint is None:
        path = local_path(hf_checkpoint, "--hf-checkpoint")
        return path, spec.hf.read_config(path)
    if checkpoint is None or hf_checkpoint is not None:
        raise GenerateError("give exactly one of --checkpoint PATH or --hf-checkpoint DIR")
    source = resolve_checkpoint(local_path(checkpoint, "--checkpoint"))
    return source, _orbax_args(source, spec)


def _tokenizer(config: JobConfig, source: Path, from_hf: bool, args: ModelArgs) -> Tokenizer:
    # A HF model directory ships its tokenizer; the recipe's is the fallback.
    path = (
        str(source)
        if from_hf and (source / "tokenizer.json").is_file()
        else config.model.tokenizer_path
    )
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > args.vocab_size:
        raise GenerateError(
            f"tokenizer {path or '(shipped)'} has vocab size "
            f"{tokenizer.vocab_size}, larger than the model's {args.vocab_size}"
        )
    return tokenizer


def _prompt_ids(tokenizer: Tokenizer, options: GenerateOptions, args: ModelArgs) -> list[int]:
    ids = tokenizer.encode(options.prompt)
    if tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids = [tokenizer.bos_id, *ids]
    if not ids:
        raise GenerateError("--prompt is empty and the tokenizer has no BOS token to start from")
    if len(ids) + options.max_new_tokens > args.max_seq_len:
        room = args.max_seq_len - len(ids)
        hint = f"lower --max-new-tokens to {room}" if room >= 1 else "shorten the prompt"
        raise GenerateError(
            f"--prompt of {len(ids)} tokens plus --max-new-tokens {options.max_new_tokens} "
            f"exceeds the model's {args.max_seq_len} positions; {hint}"
        )
    return ids


def _load_params(
    config: JobConfig, source: Path, from_hf: bool, args: ModelArgs, spec: ModelSpec
) -> tuple[Params, jax.sharding.Mesh]:
    """The weights on the shardings the recipe's mesh gives them in training (a LoRA run's
    adapters with them, then merged into the weights: decoding runs the plain model)."""
    adapters = NO_ADAPTERS if from_hf else run_lora(source, spec)
    # The mesh and shardings of training; its seq_len only has to fit the loaded model, its
    # adapters are the checkpoint's (the recipe's `[lora]` does not change what was saved).
    mesh_config = copy.deepcopy(config)
    mesh_config.training.seq_len = min(config.training.seq_len, args.max_seq_len)
    mesh_config.validation.enable = False
    lora = adapters.lora
    mesh_config.lora = (
        LoraSection(lora.rank, lora.alpha, target_modules=",".join(lora.projections))
        if lora.rank
        else LoraSection()
    )
    trainer = build_trainer(mesh_config, model_args=args)
    shardings = trainer.state_shardings["params"]
    if from_hf:
        return spec.hf.load_params(source, args, shardings), trainer.plan.mesh
    params = load_orbax(source, spec, shardings, lora)[1]
    return (merged(params, lora) if lora.rank else params), trainer.plan.mesh


def generate_text(
    config: JobConfig, checkpoint: str | None, hf_checkpoint: str | None, options: GenerateOptions
) -> tuple[str, str]:
    """(the prompt's continuation, the weights' source); stops at EOS or max_new_tokens."""
    options.validate()  # every input checked before the weights are read
    spec = get_model_spec(config.model.name)
    source, args = _source(checkpoint, hf_checkpoint, spec)
    from_hf = hf_checkpoint is not None
    tokenizer = _tokenizer(config, source, from_hf, args)
    prompt_ids = _prompt_ids(tokenizer, options, args)
    params, mesh = _load_params(config, source, from_hf, args, spec)
    dtype = resolve_param_dtype(config.training.mixed_precision_param, list(mesh.devices.flat))
    with jax.set_mesh(mesh):
        tokens = spec.generate(
            params,
            args,
            np.asarray([prompt_ids], np.int32),
            options.max_new_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed,
            eos_id=tokenizer.eos_id,
            dtype=dtype,
        )
    new = [int(t) for t in np.asarray(tokens)[0, len(prompt_ids) :]]
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    return tokenizer.decode(new), str(source)
