"""YaRN RoPE scaling's parameters and their ranges: one rule for a config's `model.yarn_*` keys
and a HF `config.json`'s `rope_parameters` (the model computes the frequencies from them:
models/qwen3/model.py)."""

from __future__ import annotations

import dataclasses
import math

MAX_SIZE = 2**31 - 1  # shapes, positions and counters inside the compiled step are int32


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling, HF's `rope_parameters` with rope_type "yarn" (transformers'
    `_compute_yarn_parameters`): frequencies that turn fewer than `beta_slow` times over
    `original_max_position_embeddings` are interpolated by `factor`, those turning more than
    `beta_fast` times are kept, a linear ramp blends between; cos/sin are scaled by the
    attention factor."""

    factor: float = 4.0
    original_max_position_embeddings: int = 32768
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0  # 0: HF's default, 0.1 * ln(factor) + 1 (1 when factor <= 1)
    truncate: bool = True  # round the ramp's ends outward to whole dims (HF's default)

    @property
    def cos_sin_scale(self) -> float:
        if self.attention_factor:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def validate(self, prefix: str = "yarn ") -> None:
        """HF's YaRN, as a range check: a ramp from the dims turning `beta_fast` times over the
        original window down to those turning `beta_slow` times (so beta_fast > beta_slow > 0:
        log(0) or an inverted ramp give NaN or silently wrong frequencies), and positions that
        the step's int32 counters hold. `prefix` names the fields as their source spells them
        (`model.yarn_`, `rope_parameters.`)."""
        numbers = {
            name: getattr(self, name)
            for name in ("factor", "beta_fast", "beta_slow", "attention_factor")
        }
        for name, value in numbers.items():
            if not math.isfinite(value):
                raise ValueError(f"{prefix}{name}={value} must be a finite number")
        if not self.factor >= 1:
            raise ValueError(f"{prefix}factor={self.factor} must be >= 1")
        if not 1 <= self.original_max_position_embeddings <= MAX_SIZE:
            raise ValueError(
                f"{prefix}original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be in [1, {MAX_SIZE}]"
            )
        if self.factor * self.original_max_position_embeddings > MAX_SIZE:
            raise ValueError(
                f"{prefix}factor={self.factor} times original_max_position_"
                f"embeddings={self.original_max_position_embeddings} exceeds "
                f"{MAX_SIZE} positions (int32)"
            )
        if not self.beta_slow > 0:
            raise ValueError(f"{prefix}beta_slow={self.beta_slow} must be > 0")
        if not self.beta_fast > self.beta_slow:
            raise ValueError(
                f"{prefix}beta_fast={self.beta_fast} must be > beta_slow="
                f"{self.beta_slow} (the ramp runs from beta_fast down to beta_slow)"
            )
        if self.attention_factor < 0:
            raise ValueError(
                f"{prefix}attention_factor={self.attention_factor} must be >= 0 "
                "(0: from the factor)"
            )
