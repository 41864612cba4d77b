"""Training metrics: throughput and MFU, device memory, and the log sinks.

The sinks (`MetricsLogger`) are one JSON line per logged step in `{dump_folder}/metrics.jsonl`
(a value that was not measured, such as step 1's throughput, is null; a validation's
`val_loss` and `val_perplexity` ride on its step's line), one plain text line per logged step
on stdout (TorchTitan's log line; printed with or without the bar), optional TensorBoard
scalars and wandb, a tqdm bar showing the latest loss at every step, and a loss curve drawn on
close. `metrics_header.json` describes the run's constants (the MFU peak and how it was
obtained). Only the main process writes anything.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import jax
from tqdm import tqdm

from titan_jax.config import ConfigError
from titan_jax.errors import TitanJaxError


class MetricsFileError(TitanJaxError, OSError):
    """metrics.jsonl cannot be written."""


class Throughput:
    """Step time, tokens/s and MFU from the wall time between consecutive finished steps.

    `flops_per_step` / (step time x `peak` x devices) is TorchTitan's MFU. A step whose wall
    time includes other work (compiling, a validation) is not measured: `restart()` first."""

    def __init__(
        self, tokens_per_step: int, flops_per_step: float, peak_flops: float, n_devices: int
    ):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.peak_flops, self.n_devices = peak_flops, n_devices
        self._last: float | None = None

    def restart(self) -> None:
        self._last = None

    def step_finished(self) -> dict[str, float | None]:
        """{step_time_s, tokens_per_sec, mfu_pct} of the step that just finished (None: not
        measured, as for the first step, which includes compilation)."""
        now = time.perf_counter()
        step_time = None if self._last is None else now - self._last
        self._last = now
        if not step_time:
            return {"tokens_per_sec": None, "mfu_pct": None, "step_time_s": None}
        return {
            "tokens_per_sec": self.tokens_per_step / step_time,
            "mfu_pct": 100 * self.flops_per_step / step_time / (self.peak_flops * self.n_devices),
            "step_time_s": step_time,
        }


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
    "val_loss": "validation_metrics/loss",
    "val_perplexity": "validation_metrics/perplexity",
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


def _keep_rows_through(path: Path, step: int) -> None:
    """Drops the rows of steps after `step` (and lines torn by a crash) from `path`, rewriting
    it atomically: a resumed run logs those steps again, and each step is in the file once."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step and line.endswith("\n"):
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # torn by a crash
            continue
    if kept == lines:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _json_number(value: Any) -> int | float | None:
    """A JSON-safe number: NaN, inf and unmeasured (None) become null."""
    if value is None:
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Writes metrics of logged steps to JSONL / TensorBoard / a tqdm bar; no-ops off the main
    process. Use as a context manager or call `close()`, which also draws `loss.png` where
    `plot_loss`.
    `keep_through`: the step a run starts after; earlier runs' rows past it are dropped."""

    def __init__(
        self,
        dump_folder: str | Path,
        log_freq: int,
        total_steps: int,
        enable_tensorboard: bool = False,
        tensorboard_folder: str = "tb",
        progress_bar: bool = True,
        plot_loss: bool = True,
        is_main_process: bool = True,
        enable_wandb: bool = False,
        run_config: dict[str, Any] | None = None,
        keep_through: int | None = None,
    ) -> None:
        if log_freq < 1:
            raise ValueError(f"log_freq={log_freq} must be >= 1")
        self.log_freq = log_freq
        self.total_steps = total_steps
        self.folder = Path(dump_folder)
        self._enabled = is_main_process
        self._jsonl: TextIO | None = None  # None off the main process
        self._tb: Any = None  # a tensorboardX SummaryWriter where asked for
        self._bar: tqdm | None = None
        self._wandb: WandbSink | None = None
        if not self._enabled:
            return
        path = self.folder / "metrics.jsonl"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if keep_through is not None:
                _keep_rows_through(path, keep_through)
            torn = _ends_mid_line(path)
            self._jsonl = open(path, "a", buffering=1)  # line-buffered: a crash loses no line
            if torn:  # start our first line on a fresh line
                self._jsonl.write("\n")
        except OSError as e:
            raise MetricsFileError(f"{path} cannot be written: {e.strerror or e}") from None
        if enable_tensorboard:
            from tensorboardX import SummaryWriter  # only imported when asked for

            self._tb = SummaryWriter(str(self.folder / tensorboard_folder))
        if enable_wandb:
            self._wandb = WandbSink(self.folder, run_config or {})
        self._show_bar = progress_bar
        self._plot = plot_loss
        self._postfix: dict[str, str] = {}

    def should_log(self, step: int) -> bool:
        """Steps to log: the first, every `log_freq`-th, and the last."""
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Record the metrics of `step` in every sink and move the bar to `step`."""
        if self._jsonl is None:  # not the main process
            return
        record = {"step": int(step), **{k: _json_number(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._scalars(step, {k: v for k, v in record.items() if k != "step"})
        self._postfix = {
            label: format(record[key], fmt)
            for key, (label, fmt) in _BAR_POSTFIX.items()
            if record.get(key) is not None
        }
        self.advance(step)
        self.info(format_step_line(record, self.total_steps))

    def _scalars(self, step: int, values: dict[str, float | None]) -> None:
        """TensorBoard and wandb, under TorchTitan's tags; nulls are left out."""
        tagged = {_tb_tag(k): v for k, v in values.items() if v is not None}
        if self._tb is not None:
            for tag, value in tagged.items():
                self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(step, tagged)

    def advance(self, step: int, loss: float | None = None) -> None:
        """Move the bar to `step` (for steps that are not logged), showing `loss` if given."""
        if not self._enabled:
            return
        if loss is not None:
            self._postfix["loss"] = format(loss, _BAR_POSTFIX["loss"][1])
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
        self._bar.set_postfix(self._postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def write_header(self, header: dict[str, Any]) -> None:
        """`{dump_folder}/metrics_header.json`: this run's constants (the MFU peak and its
        method, FLOPs per token, devices, ...), rewritten at every start."""
        if self._enabled:
            path = self.folder / "metrics_header.json"
            path.write_text(json.dumps(header, indent=1) + "\n")

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
        if self._wandb is not None:
            self._wandb.close()
        if self._plot:
            self._plot_loss()

    def _plot_loss(self) -> None:
        """Every logged step's training loss (a marker each) and the validation loss."""
        steps, losses = _curve(self.folder / "metrics.jsonl", "loss")
        if not steps:
            return
        val_steps, val_losses = _curve(self.folder / "metrics.jsonl", "val_loss")
        from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

        fig = Figure(figsize=(7, 4), layout="tight")
        ax = fig.subplots()
        ax.plot(steps, losses, marker=".", label="train loss")
        if val_steps:
            ax.plot(val_steps, val_losses, marker="o", label="validation loss")
        ax.set(xlabel="step", ylabel="loss", title=f"loss ({self.folder.name})")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.savefig(self.folder / "loss.png", dpi=100)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _number(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{format(value, fmt)}{unit}"


def format_step_line(record: dict[str, Any], total_steps: int) -> str:
    """One plain log line per logged step, TorchTitan style; "-" marks what was not measured."""
    get = record.get
    memory = _number(get("memory_peak_gib"), ".2f", " GiB peak")
    if get("memory_in_use_gib") is not None:
        memory += f" / {get('memory_in_use_gib'):.2f} GiB in use"
    parts = [
        f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
        f"loss {_number(get('loss'), '.4f')}",
        f"grad_norm {_number(get('grad_norm'), '.3f')}",
        f"lr {_number(get('lr'), '.2e')}",
        f"tokens/s {_number(get('tokens_per_sec'), ',.0f')}",
        f"mfu {_number(get('mfu_pct'), '.1f', '%')}",
        f"step_time {_number(get('step_time_s'), '.2f', ' s')}",
        f"memory {memory}",
    ]
    return "  ".join(parts)


def format_validation_line(step: int, values: dict[str, Any]) -> str:
    """The text line of one validation (its numbers go into the step's metrics line)."""
    if "val_rewards/accuracies" in values:  # DPO: how often the chosen's reward is higher
        second = f"val_rewards/accuracies {_number(values['val_rewards/accuracies'], '.3f')}"
    else:
        second = f"val_perplexity {_number(values.get('val_perplexity'), ',.1f')}"
    return (
        f"validation at step {step}: val_loss {_number(values.get('val_loss'), '.4f')}  "
        f"{second}  ({values['val_batches']} batches, {values['val_tokens']:,} tokens)"
    )


def _curve(jsonl: Path, key: str) -> tuple[list[int], list[float]]:
    """(steps, values of `key`) of every logged line holding it, sorted by step. A resumed run
    re-logs the steps after its checkpoint: the later line wins."""
    loss_by_step: dict[int, float] = {}
    with open(jsonl) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line torn by a crash
                continue
            if record.get(key) is not None:
                loss_by_step[int(record["step"])] = record[key]
    steps = sorted(loss_by_step)
    return steps, [loss_by_step[s] for s in steps]


# wandb is an optional extra (`pip install -e '.[wandb]'`), imported only when enabled. The run
# goes to project `$WANDB_PROJECT` (default "titan-jax") with the resolved config attached, and
# its files under the dump folder. `WANDB_MODE=offline` logs without a network or an account
# (`wandb sync` uploads later), as wandb's own environment variables allow.
class WandbSink:
    """One wandb run; `log` takes the same records as metrics.jsonl, under TensorBoard's tags."""

    def __init__(self, folder: Path, run_config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "metrics.enable_wandb=true needs the wandb package: "
                "`.venv/bin/pip install -e '.[wandb]'`"
            ) from None
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "titan-jax"),
            dir=str(folder),
            config=run_config,
            name=folder.name,
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
