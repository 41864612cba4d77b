"""A parity run: the same weights in titan-jax and in each PyTorch reference, compared in fp32.

One sequence drives the forward checks: a random prompt plus titan-jax's greedy continuation.
On it every side computes logits (max/mean |diff|, per-token KL), TorchTitan's loss, and (HF)
every parameter's gradient; the greedy check asks whether each reference would decode the same
continuation. Optionally N train steps of titan-jax's recipe run against a PyTorch loop doing
the same recipe. The report holds the figures, the bars and what failed.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from titan_jax.config import ConfigError, JobConfig
from titan_jax.data.pipeline import training_sources
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.data.windows import WindowStream
from titan_jax.models import BuildOptions, ModelArgs, get_model_spec, spec_of_args
from titan_jax.parity import BARS, REFERENCES, metrics
from titan_jax.parity.ours import TitanSide, train_trajectory
from titan_jax.parity.report import ParityReport, ReferenceResult, Trajectory
from titan_jax.train.plan_decisions import args_overrides

# Set here, by the comparison's driver, before a reference imports torch (libgomp reads it
# then), rather than by the package, which every CLI run imports for its bars: torch's OpenMP
# threads busy-wait by default, and in a process whose XLA thread pool has run the two fight
# over the cores and torch steps run ~20x slower (measured: 2 threads, 2 cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HF_INSTALL = "pip install -e '.[parity]'  (torch==2.13.0 first, then transformers==5.24.0)"


def hf_unavailable_reason() -> str | None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"{e}; install: {HF_INSTALL}"
    return None


def torch_unavailable_reason() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"{e}; install: {HF_INSTALL}"
    return None


def _compare_logits(
    result: ReferenceResult,
    ref_logits: np.ndarray,
    ours: np.ndarray,
    tokens: np.ndarray,
    prompt_len: int,
    ref_loss: float,
    our_loss: float,
) -> None:
    result.logits_max_abs_diff, result.logits_mean_abs_diff = metrics.abs_diff_stats(
        ours, ref_logits
    )
    kl = metrics.kl_per_token(ref_logits, ours)
    result.kl_per_token, result.kl_max, result.kl_mean = kl, float(kl.max()), float(kl.mean())
    result.greedy_first_mismatch = metrics.first_greedy_mismatch(ref_logits, tokens, prompt_len)
    result.greedy_match = result.greedy_first_mismatch is None
    result.loss, result.loss_abs_diff = ref_loss, abs(our_loss - ref_loss)
    result.loss_rel_diff = result.loss_abs_diff / abs(ref_loss)


def run_parity(
    args: ModelArgs,
    hf_dir: str | Path,
    *,
    references: tuple[str, ...] = REFERENCES,
    prompt_len: int = 512,
    decode_tokens: int = 32,
    seed: int = 0,
    recipe: JobConfig | None = None,
    batches: list[dict[str, np.ndarray]] | None = None,
    bars: dict[str, float] | None = None,
    weights: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> ParityReport:
    """Compares titan-jax with `references` on the HF model directory `hf_dir` (fp32).

    titan-jax reads the weights through its HF loader, the references through theirs. With
    `batches` (and the `recipe` they belong to) it also runs len(batches) train steps on both
    sides from these weights. `progress` receives a line as each phase starts.
    """
    unknown = set(references) - set(REFERENCES)
    if unknown or not references:
        raise ValueError(f"references={references!r}; valid: {', '.join(REFERENCES)}")
    if prompt_len < 1 or decode_tokens < 1:
        raise ConfigError(f"prompt_len={prompt_len} and decode_tokens={decode_tokens} must be >= 1")
    hf_dir = Path(hf_dir)
    if args.is_moe:  # HF's router has no expert bias: a trajectory must not grow one
        args = dataclasses.replace(args, load_balance_coeff=0.0)
    progress(f"titan-jax: loading {hf_dir}, greedy decode, forward, loss and gradients")
    spec = spec_of_args(args)
    model = spec.build(args, BuildOptions())
    ours = TitanSide(model, spec.hf.load_params(hf_dir, args))
    prompt = np.random.default_rng(seed).integers(0, args.vocab_size, prompt_len, dtype=np.int32)
    tokens = ours.greedy(prompt, decode_tokens)
    inputs, labels = tokens[:-1], tokens[1:]
    our_logits = ours.logits(inputs)
    our_loss, our_grads = ours.loss_and_grads(inputs, labels)

    results = {
        name: _compare_reference(
            name, args, hf_dir, our_logits, our_loss, our_grads, tokens, prompt_len, progress
        )
        for name in references
    }

    report = ParityReport(
        args,
        weights or str(hf_dir),
        prompt_len,
        decode_tokens,
        our_loss,
        results,
        dict(BARS if bars is None else bars),
    )
    if batches:
        if recipe is None:
            raise ValueError("a trajectory needs the recipe its batches belong to")
        progress(f"trajectory: {len(batches)} train steps on each side")
        report.trajectory_unavailable, report.trajectory = _trajectory(
            model, ours.params, hf_dir, recipe, batches
        )
    return report


def _compare_reference(
    name: str,
    args: ModelArgs,
    hf_dir: Path,
    our_logits: np.ndarray,
    our_loss: float,
    our_grads: Any,
    tokens: np.ndarray,
    prompt_len: int,
    progress: Callable[[str], None],
) -> ReferenceResult:
    """Reference `name` ("hf" or "torchtitan") against titan-jax's figures on `tokens`."""
    inputs, labels = tokens[:-1], tokens[1:]
    result = ReferenceResult(name)
    progress(f"{name}: loading and running the reference")
    if name == "hf":
        result.unavailable = hf_unavailable_reason()
        if result.unavailable is None:
            _compare_hf(
                result,
                args,
                hf_dir,
                our_logits,
                our_loss,
                our_grads,
                tokens,
                prompt_len,
                inputs,
                labels,
            )
        return result
    from titan_jax.parity import torchtitan_ref

    qwen3 = torchtitan_ref.as_qwen3(args)
    if qwen3 is None:
        result.unavailable = f"torchtitan's reference is Qwen3's, not {type(args).__name__}'s"
        return result
    if qwen3.yarn is not None:
        result.unavailable = (
            "torchtitan's YaRN RoPE leaves out HF's attention factor on "
            "cos/sin, so it is no reference for it (compare with "
            "--reference hf)"
        )
        return result
    result.unavailable = torch_unavailable_reason() or torchtitan_ref.unavailable_reason()
    if result.unavailable is None:
        from titan_jax.parity import hf_ref

        tt = torchtitan_ref.load_model(qwen3, hf_dir, len(inputs))
        ref_logits = torchtitan_ref.logits(tt, inputs)
        _compare_logits(
            result,
            ref_logits,
            our_logits,
            tokens,
            prompt_len,
            hf_ref.loss_of_logits(ref_logits, labels),
            our_loss,
        )
    return result


def _compare_hf(
    result: ReferenceResult,
    args: ModelArgs,
    hf_dir: Path,
    our_logits: np.ndarray,
    our_loss: float,
    our_grads: Any,
    tokens: np.ndarray,
    prompt_len: int,
    inputs: np.ndarray,
    labels: np.ndarray,
) -> None:
    from titan_jax.parity import hf_ref

    ref_logits, ref_loss, ref_grads = hf_ref.forward_loss_grads(
        hf_ref.load_model(hf_dir), inputs, labels
    )
    _compare_logits(result, ref_logits, our_logits, tokens, prompt_len, ref_loss, our_loss)
    worst, worst_name = -1.0, None
    seen = set()
    for name, grad in spec_of_args(args).hf.live_tensors(our_grads, args).items():
        seen.add(name)
        rel = metrics.rel_diff(grad, ref_grads[name])
        if not rel <= worst:  # keeps a NaN as the worst
            worst, worst_name = rel, name
    missing = set(ref_grads) - seen
    if missing:
        raise RuntimeError(f"HF parameters without a titan-jax gradient: {sorted(missing)}")
    result.grads_max_rel_diff, result.grads_worst_param = worst, worst_name


def _trajectory(
    model: Any, params: Any, hf_dir: Path, recipe: JobConfig, batches: list[dict[str, np.ndarray]]
) -> tuple[str | None, Trajectory | None]:
    """(why it could not run, or None; the trajectory)."""
    from titan_jax.parity import torchtitan_ref

    reason = hf_unavailable_reason() or torchtitan_ref.unavailable_reason()
    if reason is not None:
        return f"the PyTorch loop needs transformers and torchtitan's LR schedule: {reason}", None
    from titan_jax.parity import hf_ref

    ours, our_lrs = train_trajectory(model, params, recipe, batches)
    ref, ref_lrs = hf_ref.train_trajectory(
        hf_dir, recipe, batches, torchtitan_ref.lr_scheduler(recipe.lr_scheduler)
    )
    return None, Trajectory(ours, ref, our_lrs, ref_lrs)


def _refuse_document_mask(config: JobConfig) -> None:
    if config.training.document_mask:
        raise ConfigError(
            "training.document_mask=true: the PyTorch references of a parity "
            "trajectory attend across documents; run it with "
            "--training.document_mask false"
        )


def corpus_batches(
    config: JobConfig, vocab_size: int, steps: int, store_folder: str | None = None
) -> list[dict[str, np.ndarray]]:
    """The recipe's first `steps` batches of one data-parallel rank (local_batch_size rows).
    A file source is prepared into a store in `store_folder` (a folder of the caller's; None:
    the recipe's `{dump_folder}/data`, as training does)."""
    _refuse_document_mask(config)
    if store_folder is not None:
        config = dataclasses.replace(
            config, job=dataclasses.replace(config.job, dump_folder=store_folder)
        )
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {config.model.tokenizer_path or '(shipped)'} has vocab size "
            f"{tokenizer.vocab_size}, larger than the model's vocab_size={vocab_size}"
        )
    t = config.training
    sources = training_sources(config, tokenizer, is_first=True, barrier=lambda _: None)
    data = WindowStream(
        sources, seq_len=t.seq_len, global_batch_size=t.local_batch_size, seed=t.seed
    )
    return [next(data) for _ in range(steps)]


def run_from_config(
    config: JobConfig,
    hf_checkpoint: str | Path | None = None,
    *,
    references: tuple[str, ...] = REFERENCES,
    seq_len: int = 512,
    decode_tokens: int = 32,
    trajectory_steps: int = 0,
    bars: dict[str, float] | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> ParityReport:
    """`titan-jax parity`: the recipe's model (or a HF checkpoint) against the references.

    Without a checkpoint the model is `model.flavor` at random init (seed `training.seed`),
    exported to a temporary HF directory that both sides then load.
    """
    if trajectory_steps < 0:
        raise ConfigError(f"--trajectory-steps={trajectory_steps} must be >= 0")
    if trajectory_steps:
        _refuse_document_mask(config)  # before the model is built and exported
    seed, spec = config.training.seed, get_model_spec(config.model.name)
    with tempfile.TemporaryDirectory(prefix="titan_jax_parity_") as tmp:
        if hf_checkpoint is None:
            progress(f"random init of model.flavor={config.model.flavor}, export to HF")
            args = spec.configure(spec.flavor(config.model.flavor), args_overrides(config))
            params = jax.jit(spec.build(args, BuildOptions()).init)(jax.random.key(seed))
            spec.hf.save(tmp, params, args)
            del params  # every side loads its own copy from the files
            hf_dir = Path(tmp)
            weights = (
                f"random init of model.flavor={config.model.flavor} (seed {seed}), "
                "exported to HF safetensors"
            )
        else:
            hf_dir = Path(hf_checkpoint)
            args = spec.hf.read_config(hf_dir)
            weights = f"HF checkpoint {hf_dir}"
        # A store prepared for the trajectory lives in the temporary folder: the recipe's run
        # folder may be in use by a training run (and is not parity's to write).
        batches = (
            corpus_batches(config, args.vocab_size, trajectory_steps, store_folder=tmp)
            if trajectory_steps
            else None
        )
        return run_parity(
            args,
            hf_dir,
            references=references,
            prompt_len=seq_len,
            decode_tokens=decode_tokens,
            seed=seed,
            recipe=config,
            batches=batches,
            bars=bars,
            weights=weights,
            progress=progress,
        )
