"""Training metrics: parameter and FLOP counts, peak FLOP/s for MFU, memory, and the log sinks.

The sinks (`MetricsLogger`) are one JSON line per logged step in `{dump_folder}/metrics.jsonl`,
optional TensorBoard scalars, a tqdm bar, and a loss curve drawn on close. Only the main process
writes anything.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from titan_jax.models.qwen3.args import Qwen3Args


def count_params(args: Qwen3Args) -> dict[str, int]:
    """Analytic parameter counts of a Qwen3 model.

    `total`: every trainable parameter, the embedding counted once when tied (as HF reports).
    `embedding`: the token embedding matrix (vocab, dim).
    `active`: parameters one token uses: like `total` but each MoE layer's experts scaled by
    top_k/num_experts (the router counts in full). Equal to `total` for a dense model.
    The MoE expert-bias is a load-balancing buffer updated outside the optimizer: not counted.
    """
    d, v = args.dim, args.vocab_size
    embedding = v * d
    attention = 2 * d * args.q_dim + 2 * d * args.kv_dim + 2 * args.head_dim  # + q/k norms
    norms = 2 * d  # attention_norm, ffn_norm
    if args.is_moe:
        router = d * args.num_experts
        experts = 3 * args.num_experts * d * args.moe_inter_dim
        ffn_total = router + experts
        # Exact: experts is a multiple of num_experts (torchtitan's integer division agrees).
        ffn_active = router + experts * args.top_k // args.num_experts
    else:
        ffn_total = ffn_active = 3 * d * args.hidden_dim
    lm_head = 0 if args.tie_embeddings else v * d
    outside_layers = embedding + lm_head + d  # + final norm
    total = outside_layers + args.n_layers * (attention + norms + ffn_total)
    active = outside_layers + args.n_layers * (attention + norms + ffn_active)
    return {"total": total, "embedding": embedding, "active": active}


def flops_per_token(args: Qwen3Args, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), TorchTitan's MFU numerator.

    `6 * N + 6 * n_layers * n_heads * (2 * head_dim) * seq_len`, as in torchtitan 0.3.0
    `torchtitan/models/utils.py::get_moe_model_nparams_and_flops` (Qwen3 uses it for dense and
    MoE flavours, with head_dims = 2 * head_dim). N is `count_params(args)["active"]` minus the
    embedding when untied; when tied the shared matrix is the lm_head matmul and stays in N.
    So N counts every parameter used per token: attention and FFN projections, the MoE router in
    full, routed experts scaled by top_k/num_experts, the lm_head, and also the RMSNorm weights
    (as TorchTitan does; they are ~0.01% of N). The second term is the attention score and value
    matmuls over the full sequence (causal sparsity ignored, flash-attention recompute not
    counted).
    """
    counts = count_params(args)
    n = counts["active"] - (0 if args.tie_embeddings else counts["embedding"])
    return float(6 * n + 6 * args.n_layers * args.n_heads * (2 * args.head_dim) * seq_len)


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


def memory_stats() -> dict[str, Any]:
    """Peak and current memory of the first local device, or of this process where the device
    reports none (CPU). `source` says which: "device" or "process_rss"."""
    stats = jax.local_devices()[0].memory_stats()
    if stats and "bytes_in_use" in stats:
        return {
            "source": "device",
            "peak_bytes": stats.get("peak_bytes_in_use", stats["bytes_in_use"]),
            "bytes_in_use": stats["bytes_in_use"],
        }
    try:
        with open("/proc/self/statm") as f:
            in_use = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        in_use = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
    # The kernel updates the high-water mark lazily, so it can trail the current RSS.
    peak = max(peak, in_use or 0)
    return {"source": "process_rss", "peak_bytes": peak, "bytes_in_use": in_use}


# TensorBoard tags for the common keys (TorchTitan's names); other keys are logged as given,
# with "memory_" keys grouped under "memory/".
_TB_TAGS = {
    "loss": "loss_metrics/global_avg_loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "tokens_per_sec": "throughput/tokens_per_sec",
    "mfu_pct": "mfu_pct",
    "step_time_s": "time/step_time_s",
}


# Metrics shown on the progress bar: key -> (label, format).
_BAR_POSTFIX = {
    "loss": ("loss", ".4f"),
    "tokens_per_sec": ("tok/s", ",.0f"),
    "mfu_pct": ("mfu%", ".1f"),
}


def _tb_tag(key: str) -> str:
    if key in _TB_TAGS:
        return _TB_TAGS[key]
    if key.startswith("memory_"):
        return "memory/" + key.removeprefix("memory_")
    return key


def _ends_mid_line(path: Path) -> bool:
    """Whether a crash mid-write left `path` ending in a partial line."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _json_number(value: Any) -> int | float | None:
    """A JSON-safe number: NaN and inf become null (strict JSON has no token for them)."""
    if isinstance(value, numbers.Integral):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Writes metrics of logged steps to JSONL / TensorBoard / a tqdm bar; no-ops off the main
    process. Use as a context manager or call `close()`, which also draws `loss.png`."""

    def __init__(
        self,
        dump_folder: str,
        log_freq: int,
        total_steps: int,
        enable_tensorboard: bool = False,
        tensorboard_folder: str = "tb",
        progress_bar: bool = True,
        is_main_process: bool = True,
    ) -> None:
        if log_freq < 1:
            raise ValueError(f"log_freq={log_freq} must be >= 1")
        self.log_freq = log_freq
        self.total_steps = total_steps
        self.folder = Path(dump_folder)
        self._enabled = is_main_process
        self._jsonl = self._tb = self._bar = None
        if not self._enabled:
            return
        path = self.folder / "metrics.jsonl"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            torn = _ends_mid_line(path)
            self._jsonl = open(path, "a", buffering=1)  # line-buffered: a crash loses no line
            if torn:  # start our first line on a fresh line
                self._jsonl.write("\n")
        except OSError as e:
            raise OSError(
                f"metrics dump folder {str(self.folder)!r} is not writable: {e.strerror or e}"
            ) from e
        if enable_tensorboard:
            from tensorboardX import SummaryWriter  # only imported when asked for

            self._tb = SummaryWriter(str(self.folder / tensorboard_folder))
        self._show_bar = progress_bar

    def should_log(self, step: int) -> bool:
        """Steps to log: the first, every `log_freq`-th, and the last."""
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of `step` in every sink and move the bar to `step`."""
        if not self._enabled:
            return
        record = {"step": int(step), **{k: _json_number(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self._tb.add_scalar(_tb_tag(key), value, step)
        postfix = {
            label: format(record[key], fmt)
            for key, (label, fmt) in _BAR_POSTFIX.items()
            if record.get(key) is not None
        }
        self.advance(step)
        self._bar.set_postfix(postfix)

    def advance(self, step: int) -> None:
        """Move the bar to `step` (for steps that are not logged)."""
        if not self._enabled:
            return
        if self._bar is None:
            # Created at the first step seen so that a resumed run's rate and ETA count only
            # the steps it runs.
            self._bar = tqdm(
                total=self.total_steps,
                initial=step - 1,
                unit="step",
                dynamic_ncols=True,
                disable=not self._show_bar,
            )
        self._bar.update(step - self._bar.n)

    def info(self, msg: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._enabled:
            tqdm.write(msg)

    def close(self) -> None:
        """Flush and close the sinks, then draw the loss curve of the whole run (earlier runs'
        lines included, so a resumed run draws one curve)."""
        if not self._enabled or self._jsonl is None:
            return
        if self._bar is not None:
            self._bar.close()
        self._jsonl.close()
        self._jsonl = None
        if self._tb is not None:
            self._tb.close()
        self._plot_loss()

    def _plot_loss(self) -> None:
        steps, losses = _loss_curve(self.folder / "metrics.jsonl")
        if not steps:
            return
        from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

        fig = Figure(figsize=(7, 4), layout="tight")
        ax = fig.subplots()
        ax.plot(steps, losses)
        ax.set(xlabel="step", ylabel="loss", title=f"loss ({self.folder.name})")
        ax.grid(alpha=0.3)
        fig.savefig(self.folder / "loss.png", dpi=100)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _loss_curve(jsonl: Path) -> tuple[list[int], list[float]]:
    """(steps, losses) of every logged line, sorted by step. A resumed run re-logs the steps
    after its checkpoint: the later line wins."""
    loss_by_step: dict[int, float] = {}
    with open(jsonl) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line torn by a crash
                continue
            if record.get("loss") is not None:
                loss_by_step[int(record["step"])] = record["loss"]
    steps = sorted(loss_by_step)
    return steps, [loss_by_step[s] for s in steps]
