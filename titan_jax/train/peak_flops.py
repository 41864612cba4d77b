"""Peak FLOP/s of one device, the MFU denominator: published accelerator peaks, or a measured
matmul peak on CPUs."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per chip. First substring match of the lower-cased device_kind wins, so
# the more specific names come first ("tpu v5 lite" is v5e, a bare "tpu v5" is v5p).
_PEAK_BF16_FLOPS: tuple[tuple[str, str, float], ...] = (
    ("tpu v5 lite", "TPU v5e", 197e12),
    ("tpu v5e", "TPU v5e", 197e12),
    ("tpu v5p", "TPU v5p", 459e12),
    ("tpu v5", "TPU v5p", 459e12),
    ("tpu v6 lite", "TPU v6e", 918e12),
    ("tpu v6e", "TPU v6e", 918e12),
    ("tpu v4", "TPU v4", 275e12),
    ("a100", "A100", 312e12),
    ("h100 pcie", "H100 PCIe", 756e12),
    ("h100", "H100 SXM", 989e12),
    ("h200", "H200", 989e12),
)


def peak_flops_per_device(device: jax.Device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from), the MFU denominator.

    Known accelerators get their published dense bf16 peak whatever `dtype` is (the MFU
    convention). A CPU, or an accelerator not in the table, gets a measured matmul peak in
    `dtype`, cached per dtype, processor and jax version so later runs skip the measurement.
    """
    kind = device.device_kind
    for key, name, peak in _PEAK_BF16_FLOPS:
        if key in kind.lower():
            return peak, f"{name} dense bf16 peak"
    dtype = jnp.dtype(dtype).name
    is_cpu = device.platform == "cpu"
    processor = _cpu_model() if is_cpu else kind
    peak, cached = _cached_measurement(f"{dtype}|{processor}|jax-{jax.__version__}", device, dtype)
    how = "cached" if cached else "measured now"
    if is_cpu:
        return peak, f"measured CPU matmul peak ({dtype}, {how})"
    return peak, f"unknown device kind {kind!r}: measured matmul peak ({dtype}, {how})"


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "titan_jax" / "peak_flops.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cached_measurement(key: str, device: jax.Device, dtype: str) -> tuple[float, bool]:
    """(FLOP/s, whether it came from the cache)."""
    path = _cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):  # absent or corrupt: measure again
        cache = {}
    if key in cache:
        return float(cache[key]), True
    peak = _measure_matmul_flops(device, dtype)
    cache[key] = peak
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: concurrent processes never read a half-written file
    except OSError:
        pass  # a read-only home only costs a re-measurement next run
    return peak, False


def _measure_matmul_flops(device: jax.Device, dtype: str, n: int = 2048, runs: int = 5) -> float:
    """Median FLOP/s of a jitted n^3 matmul on `device` (~1 s at 2048 on a 2-core CPU)."""
    x = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(jnp.matmul)
    matmul(x, x).block_until_ready()  # compile and warm up outside the timed runs
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        matmul(x, x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)
