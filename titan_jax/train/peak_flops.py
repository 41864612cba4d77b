"""Peak FLOP/s of one device, the MFU denominator: published accelerator peaks, or a matmul peak
measured at the start of the run on CPUs.

MFU follows the convention of TorchTitan and MaxText: model FLOPs per second over the chip's
published dense bf16 peak, whatever dtype the run computes in. A CPU has no published peak, so
it gets `measure_matmul_flops`: the median of several timed n^3 matmuls in the run's dtype,
measured now (never read back from an earlier run: a number measured once under load made the
same run read 45% against one peak and 24% against another). `metrics.peak_flops` overrides both.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per JAX device (vendor datasheets, without sparsity): a chip, or for
# TPU7x (Ironwood), which JAX shows as two devices, half of one. First substring match
# of the lower-cased device_kind wins, so more specific names come first ("tpu v5 lite" is v5e,
# a bare "tpu v5" is v5p; "h100 pcie" before "h100").
PEAK_BF16_FLOPS: tuple[tuple[str, str, float], ...] = (
    ("tpu v5 lite", "TPU v5e", 197e12),
    ("tpu v5e", "TPU v5e", 197e12),
    ("tpu v5p", "TPU v5p", 459e12),
    ("tpu v5", "TPU v5p", 459e12),
    ("tpu v6 lite", "TPU v6e", 918e12),
    ("tpu v6e", "TPU v6e", 918e12),
    ("tpu7x", "TPU v7x TensorCore", 2307e12 / 2),  # JAX's device: one of a chip's two
    ("tpu v4", "TPU v4", 275e12),
    ("tpu v3", "TPU v3", 123e12),
    ("a100", "A100", 312e12),
    ("h100 pcie", "H100 PCIe", 756e12),
    ("h100", "H100 SXM", 989e12),
    ("h200", "H200", 989e12),
    ("b200", "B200", 2250e12),
    ("l40s", "L40S", 362e12),
    ("l4", "L4", 121e12),
)
# n of the timed n^3 matmul: large enough for a CPU's GEMM peak (on a 2-core x86 host 1024^3
# measured the rate that 2048^3 did, at an eighth of the work every run pays at start).
MATMUL_SIZE = 1024
MATMUL_RUNS = 7  # timed runs after one warm-up; the median resists a busy neighbour


@dataclasses.dataclass(frozen=True)
class PeakFlops:
    """The MFU denominator and how it was obtained (recorded in the metrics header)."""

    flops_per_device: float
    method: str  # "published", "measured" or "override"
    source: str  # a sentence: which table entry, or what was measured and how

    def to_json(self) -> dict[str, float | str]:
        return {
            "peak_flops_per_device": self.flops_per_device,
            "peak_flops_method": self.method,
            "peak_flops_source": self.source,
        }


def published_peak(device_kind: str) -> tuple[str, float] | None:
    """(chip name, dense bf16 peak FLOP/s) of a known accelerator kind, else None."""
    kind = device_kind.lower()
    for key, name, peak in PEAK_BF16_FLOPS:
        if key in kind:
            return name, peak
    return None


def peak_flops_per_device(
    device: jax.Device, dtype: str, override: float | None = None
) -> PeakFlops:
    """The MFU denominator of one device: `override` if given, else the published bf16 peak of a
    known accelerator, else a matmul peak in `dtype` measured now on `device`."""
    if override is not None:
        return PeakFlops(override, "override", f"metrics.peak_flops={override:g}")
    known = published_peak(device.device_kind)
    if known is not None:
        name, peak = known
        return PeakFlops(peak, "published", f"{name} dense bf16 peak (published)")
    dtype = jnp.dtype(dtype).name
    peak = measure_matmul_flops(device, dtype)
    what = "CPU" if device.platform == "cpu" else f"unknown device kind {device.device_kind!r}:"
    return PeakFlops(
        peak,
        "measured",
        f"{what} matmul peak measured at start: median of {MATMUL_RUNS} timed "
        f"{MATMUL_SIZE}^3 {dtype} matmuls after a warm-up",
    )


def measure_matmul_flops(
    device: jax.Device, dtype: str, n: int = MATMUL_SIZE, runs: int = MATMUL_RUNS
) -> float:
    """Median FLOP/s of a jitted n^3 matmul on `device`, compiled and warmed up first."""
    x = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(jnp.matmul)
    matmul(x, x).block_until_ready()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        matmul(x, x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)
