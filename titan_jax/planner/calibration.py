"""The step-time estimate against programs others ran on TPU hardware, and the band every
printed estimate carries from it.

Each point is a published step time beside the estimate of the same program compiled here
for the same slice (MaxText's programs of tpu-recipes' recipes: `benchmarks/maxtext_aot.py
--calibrate`; the TorchTitan fork's Qwen3-8B recipe: titan-jax's program of it, `make plans`).
The residual is the measured over the estimated step time, less one (positive: the estimate
errs fast). The band applies the worst residuals above and below to any estimate: a measured
step is expected between `est x (1 + lowest)` and `est x (1 + highest)`. docs/TPU.md
("Calibration") shows this table with what moved each residual.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Point:
    name: str  # model, sequence, precision, slice
    measured_step_s: float  # on hardware, as published
    estimated_step_s: float  # the estimate of the program compiled here
    source: str

    @property
    def residual(self) -> float:
        return self.measured_step_s / self.estimated_step_s - 1


# Priced 2026-12-06 (jax 0.12.0.1, libtpu 0.0.50.1, MaxText 0.2.5) with the sustained rates of
# planner/sustained.py; the programs are kept by `maxtext_aot.py --keep` / `tpu_plans.py
# --dumps` and re-priced from there.
POINTS = (
    Point(
        "Qwen3-8B 6 x 2048, v6e-8 (titan-jax's program of the TorchTitan fork's recipe)",
        1.85,
        1.459,
        "TorchTitan TPU fork 45e604e (torch_xla): 35-36% MFU, ~1.85 s at 35.5%",
    ),
    Point(
        "Mistral-7B 6 x 8192, v6e-8 (MaxText's program)",
        6.320,
        5.332,
        "tpu-recipes training/trillium/Mistral-7B-MaxText: 6.320 s, 432.0 TFLOP/s",
    ),
    Point(
        "Llama3.1-70B 2 x 8192, v6e-32 (MaxText's program)",
        17.790,
        12.956,
        "tpu-recipes training/trillium/Llama3.1-70B-MaxText/v6e-32: 17.790 s, 443.4 TFLOP/s",
    ),
    Point(
        "gpt-oss-120b 10 x 8192 a TensorCore, tpu7x-128 (MaxText's program)",
        14.93,
        21.770,
        "tpu-recipes training/ironwood/gpt-oss-120b/8k-bf16-tpu7x-4x4x4: 14.93 s, 378.90 TFLOP/s",
    ),
    Point(
        "Qwen3-235B-A22B 16 x 4096 a TensorCore, tpu7x-512 (MaxText's program)",
        30.87,
        29.896,
        "tpu-recipes training/ironwood/qwen3-235b-a22b/4k-bf16-tpu7x-4x8x8: "
        "30.87 s, 629.79 TFLOP/s",
    ),
    Point(
        "Llama3.1-70B 2 x 8192 a TensorCore, tpu7x-128 (MaxText's program)",
        12.20,
        11.441,
        "tpu-recipes training/ironwood/llama3.1-70b/8k-bf16-tpu7x-4x4x4: 12.20 s, 1207.05 TFLOP/s",
    ),
    Point(
        "Llama4-Scout-17B-16E 8 x 8192, v5p-256 (MaxText's program)",
        31.652,
        26.816,
        "tpu-recipes training/v5p/Llama4-Scout-17B-16E-Maxtext: 31.652 s, 225.491 TFLOP/s",
    ),
    Point(
        "Mixtral-8x7B 12 x 4096, v6e-256, dropping (MaxText's program)",
        13.484,
        11.902,
        "tpu-recipes training/trillium/Mixtral-8x7B-MaxText: 13.484 s, 302.311 TFLOP/s",
    ),
    Point(
        "Mixtral-8x22B 8 x 4096, v6e-256, fsdp64 x ep4, dropping (MaxText's program)",
        24.706,
        21.120,
        "tpu-recipes training/trillium/Mixtral-8x22B-MaxText: 24.706 s, 332.463 TFLOP/s",
    ),
)


def residuals() -> tuple[float, float]:
    """The calibration's lowest and highest residual."""
    return min(p.residual for p in POINTS), max(p.residual for p in POINTS)


def step_band(step_s: float, floor_s: float = 0.0) -> tuple[float, float]:
    """The step times the calibration's worst residuals allow around an estimate, none below
    `floor_s` (the roofline bound: compute at bf16's peak, collectives hidden), which no step
    beats. A floor above the estimate bounds nothing (int8/fp8 matmuls run above bf16's peak)
    and is ignored."""
    lowest, highest = residuals()
    floor = floor_s if floor_s <= step_s else 0.0
    return max(step_s * (1 + lowest), floor), step_s * (1 + highest)


def mfu_band(mfu: float, ceiling: float = 100.0) -> tuple[float, float]:
    """The MFUs the calibration's worst residuals allow around an estimated MFU, none above
    `ceiling` (the roofline bound's MFU; ignored below the estimate, as `step_band`'s floor)."""
    lowest, highest = residuals()
    top = mfu / (1 + lowest)
    return mfu / (1 + highest), min(top, ceiling) if ceiling >= mfu else top


def with_band(step_s: float, mfu_pct: float | None = None, roofline_mfu_pct: float = 100.0) -> str:
    """An estimate as printed, "step s (low-high s)", with "/ MFU% (low-high%)" if given; the
    band stops at the roofline bound (`roofline_mfu_pct`, whose step is the estimate's scaled by
    the two MFUs: the same FLOPs)."""
    floor = step_s * mfu_pct / roofline_mfu_pct if mfu_pct is not None else 0.0
    low, high = step_band(step_s, floor)
    text = f"{step_s:.2f} s ({low:.2f}-{high:.2f} s)"
    if mfu_pct is not None:
        mfu_low, mfu_high = mfu_band(mfu_pct, roofline_mfu_pct)
        text += f" / {mfu_pct:.0f}% ({mfu_low:.0f}-{mfu_high:.0f}%)"
    return text
