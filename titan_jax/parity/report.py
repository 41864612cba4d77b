"""A parity run's figures: each reference's against titan-jax, the trajectory, the verdict."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

import jax
import numpy as np

from titan_jax.models import ModelArgs, spec_of_args


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
        return [
            abs(a - b) / abs(b)
            for a, b in zip(self.titan_jax_losses, self.torch_losses, strict=True)
        ]

    @property
    def max_rel_diff(self) -> float:
        return max(self.rel_diffs)

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": len(self.torch_losses),
            **dataclasses.asdict(self),
            "rel_diffs": self.rel_diffs,
            "max_rel_diff": self.max_rel_diff,
        }


@dataclasses.dataclass
class ParityReport:
    args: ModelArgs  # the compared model's args (its family's dataclass)
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
                out.append(
                    f"{r.name}: greedy decode differs from titan-jax's at token "
                    f"{r.greedy_first_mismatch}"
                )
        if self.trajectory_unavailable is not None:
            out.append(f"trajectory: unavailable: {self.trajectory_unavailable}")
        elif self.trajectory is not None:
            bar, value = self.bars["trajectory_max_rel_diff"], self.trajectory.max_rel_diff
            if not value <= bar:
                out.append(
                    f"trajectory: max per-step loss rel diff {value:.3g} is over the bar {bar:g}"
                )
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
            f"titan-jax parity: {spec_of_args(a).name} dim={a.dim} layers={a.n_layers} "
            f"heads={a.n_heads}/{a.n_kv_heads} head_dim={a.head_dim} ffn={a.hidden_dim} "
            f"vocab={a.vocab_size} {'tied' if a.tie_embeddings else 'untied'}",
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

        for label, key in (
            ("logits max |diff|", "logits_max_abs_diff"),
            ("logits mean |diff|", "logits_mean_abs_diff"),
            ("KL max", "kl_max"),
            ("KL mean", "kl_mean"),
            (f"greedy {self.decode_tokens} tokens", "greedy_match"),
            ("loss", "loss"),
            ("loss |diff|", "loss_abs_diff"),
            ("loss rel diff", "loss_rel_diff"),
            ("grads max rel diff", "grads_max_rel_diff"),
        ):
            bar = (
                "identical"
                if key == "greedy_match"
                else f"<= {self.bars[key]:g}"
                if key in self.bars
                else ""
            )
            lines.append(row.format(label, *(cell(r, key) for r in refs), bar))
        for r in refs:
            if r.grads_worst_param is not None:
                lines.append(f"  {r.name} worst gradient: {r.grads_worst_param}")
            if r.unavailable is not None:
                lines.append(f"  {r.name} unavailable: {r.unavailable}")
            elif r.name == "torchtitan":
                lines.append(
                    "  torchtitan: forward only on CPU (flex attention has no CPU "
                    "backward), so no gradients"
                )
        lines += self._trajectory_lines()
        failures = self.failures()
        lines += ["", "PASS" if not failures else "FAIL"]
        lines += [f"  - {f}" for f in failures]
        return "\n".join(lines)

    def _trajectory_lines(self) -> list[str]:
        if self.trajectory is None:
            if self.trajectory_unavailable is None:
                return []
            return ["", f"trajectory unavailable: {self.trajectory_unavailable}"]
        t = self.trajectory
        lines = [
            "",
            f"trajectory: {len(t.torch_losses)} steps of the recipe, titan-jax "
            "train_step vs HF model + torch AdamW + torchtitan LR schedule + "
            "clip_grad_norm_",
            f"{'step':>6}{'lr':>12}{'titan-jax':>14}{'torch':>14}{'rel diff':>12}",
        ]
        for i, (lr, ours, ref, rel) in enumerate(
            zip(t.torch_lrs, t.titan_jax_losses, t.torch_losses, t.rel_diffs, strict=True)
        ):
            lines.append(f"{i + 1:>6}{lr:>12.3g}{ours:>14.6f}{ref:>14.6f}{rel:>12.2e}")
        lines.append(
            f"max per-step loss rel diff {t.max_rel_diff:.3g} "
            f"(bar <= {self.bars['trajectory_max_rel_diff']:g})"
        )
        return lines


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"jax": jax.__version__}
    for package in ("torch", "transformers", "torchtitan"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out
