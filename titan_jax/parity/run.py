"""A parity run: the same weights in titan-jax and in each PyTorch reference, compared in fp32.

One sequence drives the forward checks: a random prompt plus titan-jax's greedy continuation.
On it every side computes logits (max/mean |diff|, per-token KL), TorchTitan's loss, and (HF)
every parameter's gradient; the greedy check asks whether each reference would decode the same
continuation. Optionally N train steps of titan-jax's recipe run against a PyTorch loop doing
the same recipe. The report holds the figures, the bars and what failed.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
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
from titan_jax.models.qwen3 import Qwen3Args, build_model_def, get_flavor
from titan_jax.models.qwen3.hf import iter_hf_tensors, load_hf_params, save_hf
from titan_jax.models.qwen3.hf_config import read_hf_config
from titan_jax.models.qwen3.hf_tensors import fused_expert_layout
from titan_jax.parity import BARS, REFERENCES, metrics
from titan_jax.parity.ours import TitanSide, train_trajectory

HF_INSTALL = "pip install -e '.[parity]'  (torch==2.13.0 first, then transformers==5.24.0)"


@dataclasses.dataclass
class ReferenceResult:
    """One reference's figures against titan-jax (None: not computed for this reference)."""

    name: str
    unavailable: str | None = None  # why this reference could not run
    logits_max_abs_diff: float | None = None
    logits_mean_abs_diff: float | None = None
    kl_max: float | None = None
    kl_mean: float | None = None
    greedy_match: bool | None = None
    greedy_first_mismatch: int | None = None  # index into the decoded tokens
    loss: float | None = None
    loss_abs_diff: float | None = None
    loss_rel_diff: float | None = None
    grads_max_rel_diff: float | None = None
    grads_worst_param: str | None = None
    kl_per_token: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "kl_per_token"}


@dataclasses.dataclass
class Trajectory:
    titan_jax_losses: list[float]
    torch_losses: list[float]
    titan_jax_lrs: list[float]
    torch_lrs: list[float]

    @property
    def rel_diffs(self) -> list[float]:
        return [abs(a - b) / abs(b) for a, b in zip(self.titan_jax_losses, self.torch_losses,
                                                      strict=True)]

    @property
    def max_rel_diff(self) -> float:
        return max(self.rel_diffs)

    def to_json(self) -> dict[str, Any]:
        return {"steps": len(self.torch_losses), **dataclasses.asdict(self),
                "rel_diffs": self.rel_diffs, "max_rel_diff": self.max_rel_diff}


@dataclasses.dataclass
class ParityReport:
    args: Qwen3Args
    weights: str  # where the weights came from
    prompt_len: int
    decode_tokens: int
    loss: float  # titan-jax's loss on the compared sequence
    references: dict[str, ReferenceResult]
    bars: dict[str, float]
    trajectory: Trajectory | None = None
    trajectory_unavailable: str | None = None

    def _ran(self) -> list[ReferenceResult]:
        return [r for r in self.references.values() if r.unavailable is None]

    def _worst(self, key: str) -> float | None:
        values = [getattr(r, key) for r in self._ran() if getattr(r, key) is not None]
        return max(values) if values else None

    def summary(self) -> dict[str, Any]:
        """The headline figures, each the worst over the references that computed it."""
        greedy = [r.greedy_match for r in self._ran()]
        return {
            "logits_max_abs_diff": self._worst("logits_max_abs_diff"),
            "kl_max": self._worst("kl_max"),
            "greedy_match": all(greedy) if greedy else None,
            "loss_abs_diff": self._worst("loss_abs_diff"),
            "grads_max_rel_diff": self._worst("grads_max_rel_diff"),
            "trajectory_max_rel_diff": self.trajectory.max_rel_diff if self.trajectory else None,
            "logits_mean_abs_diff": self._worst("logits_mean_abs_diff"),
            "kl_mean": self._worst("kl_mean"),
            "loss_rel_diff": self._worst("loss_rel_diff"),
        }

    def failures(self) -> list[str]:
        out = []
        for r in self.references.values():
            if r.unavailable is not None:
                out.append(f"{r.name}: unavailable: {r.unavailable}")
                continue
            for key, bar in self.bars.items():
                value = getattr(r, key, None)
                if value is not None and not value <= bar:  # `not <=` also catches NaN
                    out.append(f"{r.name}: {key}={value:.3g} is over the bar {bar:g}")
            if not r.greedy_match:
                out.append(f"{r.name}: greedy decode differs from titan-jax's at token "
                           f"{r.greedy_first_mismatch}")
        if self.trajectory_unavailable is not None:
            out.append(f"trajectory: unavailable: {self.trajectory_unavailable}")
        elif self.trajectory is not None:
            bar, value = self.bars["trajectory_max_rel_diff"], self.trajectory.max_rel_diff
            if not value <= bar:
                out.append(f"trajectory: max per-step loss rel diff {value:.3g} is over the "
                           f"bar {bar:g}")
        return out

    def to_json(self) -> dict[str, Any]:
        failures = self.failures()
        return {
            **self.summary(),
            "passed": not failures,
            "failures": failures,
            "bars": self.bars,
            "references": {k: r.to_json() for k, r in self.references.items()},
            "trajectory": self.trajectory.to_json() if self.trajectory else None,
            "trajectory_unavailable": self.trajectory_unavailable,
            "loss": self.loss,
            "model": dataclasses.asdict(self.args),
            "weights": self.weights,
            "prompt_len": self.prompt_len,
            "decode_tokens": self.decode_tokens,
            "dtype": "float32",
            "versions": _versions(),
        }

    def table(self) -> str:
        """A readable report: one column per reference, the bar, then PASS or what failed."""
        a = self.args
        lines = [
            f"titan-jax parity: qwen3 dim={a.dim} layers={a.n_layers} heads={a.n_heads}/"
            f"{a.n_kv_heads} head_dim={a.head_dim} ffn={a.hidden_dim} vocab={a.vocab_size} "
            f"{'tied' if a.tie_embeddings else 'untied'}",
            f"weights: {self.weights}",
            f"fp32; prompt {self.prompt_len} random tokens + {self.decode_tokens} greedy tokens; "
            f"titan-jax loss {self.loss:.6f}",
            "",
        ]
        refs = list(self.references.values())
        row = "{:<22}" + "{:>16}" * len(refs) + "  {}"
        lines.append(row.format("", *(r.name for r in refs), "bar"))

        def cell(r: ReferenceResult, key: str) -> str:
            if r.unavailable is not None:
                return "unavailable"
            value = getattr(r, key)
            if value is None:
                return "n/a"
            if isinstance(value, bool):
                return "identical" if value else f"differs @{r.greedy_first_mismatch}"
            return f"{value:.6f}" if key == "loss" else f"{value:.3g}"

        for label, key in (("logits max |diff|", "logits_max_abs_diff"),
                           ("logits mean |diff|", "logits_mean_abs_diff"),
                           ("KL max", "kl_max"), ("KL mean", "kl_mean"),
                           (f"greedy {self.decode_tokens} tokens", "greedy_match"),
                           ("loss", "loss"), ("loss |diff|", "loss_abs_diff"),
                           ("loss rel diff", "loss_rel_diff"),
                           ("grads max rel diff", "grads_max_rel_diff")):
            bar = ("identical" if key == "greedy_match" else
                   f"<= {self.bars[key]:g}" if key in self.bars else "")
            lines.append(row.format(label, *(cell(r, key) for r in refs), bar))
        for r in refs:
            if r.grads_worst_param is not None:
                lines.append(f"  {r.name} worst gradient: {r.grads_worst_param}")
            if r.unavailable is not None:
                lines.append(f"  {r.name} unavailable: {r.unavailable}")
            elif r.name == "torchtitan":
                lines.append("  torchtitan: forward only on CPU (flex attention has no CPU "
                             "backward), so no gradients")
        if self.trajectory is not None:
            t = self.trajectory
            lines += ["", f"trajectory: {len(t.torch_losses)} steps of the recipe, titan-jax "
                      "train_step vs HF model + torch AdamW + torchtitan LR schedule + "
                      "clip_grad_norm_",
                      f"{'step':>6}{'lr':>12}{'titan-jax':>14}{'torch':>14}{'rel diff':>12}"]
            for i, (lr, ours, ref, rel) in enumerate(zip(
                    t.torch_lrs, t.titan_jax_losses, t.torch_losses, t.rel_diffs, strict=True)):
                lines.append(f"{i + 1:>6}{lr:>12.3g}{ours:>14.6f}{ref:>14.6f}{rel:>12.2e}")
            lines.append(f"max per-step loss rel diff {t.max_rel_diff:.3g} "
                         f"(bar <= {self.bars['trajectory_max_rel_diff']:g})")
        elif self.trajectory_unavailable is not None:
            lines += ["", f"trajectory unavailable: {self.trajectory_unavailable}"]
        failures = self.failures()
        lines += ["", "PASS" if not failures else "FAIL"]
        lines += [f"  - {f}" for f in failures]
        return "\n".join(lines)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"jax": jax.__version__}
    for package in ("torch", "transformers", "torchtitan"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


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


def _compare_logits(result: ReferenceResult, ref_logits: np.ndarray, ours: np.ndarray,
                    tokens: np.ndarray, prompt_len: int, ref_loss: float, our_loss: float
                    ) -> None:
    result.logits_max_abs_diff, result.logits_mean_abs_diff = metrics.abs_diff_stats(
        ours, ref_logits)
    kl = metrics.kl_per_token(ref_logits, ours)
    result.kl_per_token, result.kl_max, result.kl_mean = kl, float(kl.max()), float(kl.mean())
    result.greedy_first_mismatch = metrics.first_greedy_mismatch(ref_logits, tokens, prompt_len)
    result.greedy_match = result.greedy_first_mismatch is None
    result.loss, result.loss_abs_diff = ref_loss, abs(our_loss - ref_loss)
    result.loss_rel_diff = result.loss_abs_diff / abs(ref_loss)


def run_parity(args: Qwen3Args, hf_dir: str | Path, *,
               references: tuple[str, ...] = REFERENCES, prompt_len: int = 512,
               decode_tokens: int = 32, seed: int = 0, recipe: JobConfig | None = None,
               batches: list[dict[str, np.ndarray]] | None = None,
               bars: dict[str, float] | None = None, weights: str | None = None,
               progress: Callable[[str], None] = lambda _: None) -> ParityReport:
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
    model = build_model_def(args)
    ours = TitanSide(model, load_hf_params(hf_dir, args))
    prompt = np.random.default_rng(seed).integers(0, args.vocab_size, prompt_len, dtype=np.int32)
    tokens = ours.greedy(prompt, decode_tokens)
    inputs, labels = tokens[:-1], tokens[1:]
    our_logits = ours.logits(inputs)
    our_loss, our_grads = ours.loss_and_grads(inputs, labels)

    results: dict[str, ReferenceResult] = {}
    for name in references:
        result = results[name] = ReferenceResult(name)
        progress(f"{name}: loading and running the reference")
        if name == "hf":
            result.unavailable = hf_unavailable_reason()
            if result.unavailable is None:
                _compare_hf(result, args, hf_dir, our_logits, our_loss, our_grads, tokens,
                            prompt_len, inputs, labels)
        else:
            from titan_jax.parity import torchtitan_ref

            result.unavailable = torch_unavailable_reason() or torchtitan_ref.unavailable_reason()
            if result.unavailable is None:
                from titan_jax.parity import hf_ref

                tt = torchtitan_ref.load_model(args, hf_dir, len(inputs))
                ref_logits = torchtitan_ref.logits(tt, inputs)
                _compare_logits(result, ref_logits, our_logits, tokens, prompt_len,
                                hf_ref.loss_of_logits(ref_logits, labels), our_loss)

    report = ParityReport(args, weights or str(hf_dir), prompt_len, decode_tokens, our_loss,
                          results, dict(BARS if bars is None else bars))
    if batches:
        if recipe is None:
            raise ValueError("a trajectory needs the recipe its batches belong to")
        progress(f"trajectory: {len(batches)} train steps on each side")
        report.trajectory_unavailable, report.trajectory = _trajectory(
            model, ours.params, hf_dir, recipe, batches)
    return report


def _compare_hf(result: ReferenceResult, args: Qwen3Args, hf_dir: Path, our_logits: np.ndarray,
                our_loss: float, our_grads: Any, tokens: np.ndarray, prompt_len: int,
                inputs: np.ndarray, labels: np.ndarray) -> None:
    from titan_jax.parity import hf_ref

    ref_logits, ref_loss, ref_grads = hf_ref.forward_loss_grads(
        hf_ref.load_model(hf_dir), inputs, labels)
    _compare_logits(result, ref_logits, our_logits, tokens, prompt_len, ref_loss, our_loss)
    worst, worst_name = -1.0, None
    seen = set()
    named = dict(iter_hf_tensors(our_grads, args))
    if args.is_moe:  # a live transformers 5 model fuses each layer's experts
        named = fused_expert_layout(named, args)
    for name, grad in named.items():
        seen.add(name)
        rel = metrics.rel_diff(grad, ref_grads[name])
        if not rel <= worst:  # keeps a NaN as the worst
            worst, worst_name = rel, name
    missing = set(ref_grads) - seen
    if missing:
        raise RuntimeError(f"HF parameters without a titan-jax gradient: {sorted(missing)}")
    result.grads_max_rel_diff, result.grads_worst_param = worst, worst_name


def _trajectory(model: Any, params: Any, hf_dir: Path, recipe: JobConfig,
                batches: list[dict[str, np.ndarray]]) -> tuple[str | None, Trajectory | None]:
    """(why it could not run, or None; the trajectory)."""
    from titan_jax.parity import torchtitan_ref

    reason = hf_unavailable_reason() or torchtitan_ref.unavailable_reason()
    if reason is not None:
        return f"the PyTorch loop needs transformers and torchtitan's LR schedule: {reason}", None
    from titan_jax.parity import hf_ref

    ours, our_lrs = train_trajectory(model, params, recipe, batches)
    ref, ref_lrs = hf_ref.train_trajectory(hf_dir, recipe, batches,
                                           torchtitan_ref.lr_scheduler(recipe.lr_scheduler))
    return None, Trajectory(ours, ref, our_lrs, ref_lrs)


def corpus_batches(config: JobConfig, vocab_size: int, steps: int
                   ) -> list[dict[str, np.ndarray]]:
    """The recipe's first `steps` batches of one data-parallel rank (local_batch_size rows)."""
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {config.model.tokenizer_path or '(shipped)'} has vocab size "
            f"{tokenizer.vocab_size}, larger than the model's vocab_size={vocab_size}"
        )
    t = config.training
    sources = training_sources(config, tokenizer, is_first=True, barrier=lambda _: None)
    data = WindowStream(sources, seq_len=t.seq_len, global_batch_size=t.local_batch_size,
                        seed=t.seed)
    return [next(data) for _ in range(steps)]


def run_from_config(config: JobConfig, hf_checkpoint: str | Path | None = None, *,
                    references: tuple[str, ...] = REFERENCES, seq_len: int = 512,
                    decode_tokens: int = 32, trajectory_steps: int = 0,
                    bars: dict[str, float] | None = None,
                    progress: Callable[[str], None] = lambda _: None) -> ParityReport:
    """`titan-jax parity`: the recipe's model (or a HF checkpoint) against the references.

    Without a checkpoint the model is `model.flavor` at random init (seed `training.seed`),
    exported to a temporary HF directory that both sides then load.
    """
    if trajectory_steps < 0:
        raise ConfigError(f"--trajectory-steps={trajectory_steps} must be >= 0")
    seed = config.training.seed
    with tempfile.TemporaryDirectory(prefix="titan_jax_parity_") as tmp:
        if hf_checkpoint is None:
            progress(f"random init of model.flavor={config.model.flavor}, export to HF")
            args = get_flavor(config.model.flavor)
            params = jax.jit(build_model_def(args).init)(jax.random.key(seed))
            save_hf(tmp, params, args)
            del params  # every side loads its own copy from the files
            hf_dir = Path(tmp)
            weights = (f"random init of model.flavor={config.model.flavor} (seed {seed}), "
                       "exported to HF safetensors")
        else:
            hf_dir = Path(hf_checkpoint)
            args = read_hf_config(hf_dir)
            weights = f"HF checkpoint {hf_dir}"
        batches = corpus_batches(config, args.vocab_size, trajectory_steps) \
            if trajectory_steps else None
        return run_parity(args, hf_dir, references=references, prompt_len=seq_len,
                          decode_tokens=decode_tokens, seed=seed, recipe=config,
                          batches=batches, bars=bars, weights=weights, progress=progress)
