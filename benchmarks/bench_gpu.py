"""One-GPU training-step benchmark of real Qwen3 flavours (run by benchmarks/gpu.sh on an H200).

For each flavour (default 0.6B and 1.7B) times the jitted whole step (bf16 compute via
`training.mixed_precision_param=auto`, fp32 master weights and AdamW state) on random tokens:
compile time, median step time after warm-up, tokens/s, MFU against the device's published dense
bf16 peak (H200: 989 TFLOP/s, half the datasheet's 1,979 "with sparsity"; NVIDIA H200 Tensor Core
GPU datasheet), and peak device memory (`memory_stats()["peak_bytes_in_use"]`) next to XLA's
compile-time estimate. Each (flavour, batch) runs in its own process, so each peak is that run's
alone and a crash or OOM costs only that row; on OOM the batch is halved and tried again.

Attention: `--attention cudnn` is passed as `--model.attention cudnn` only if this checkout's
config has that field and accepts the value; otherwise the model's default is used (and said).
`--smoke` runs a tiny model on whatever device JAX has (CPU in tests) through the same path.
Results go to OUT_DIR/gpu_bench-<UTC time>.{json,md} (never overwriting), rewritten after each row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from titan_jax.atomic_dir import write_text_atomic
from titan_jax.config import ConfigError, load_config
from titan_jax.models.qwen3 import Qwen3Args
from titan_jax.train.metrics import memory_stats
from titan_jax.train.peak_flops import peak_flops_per_device
from titan_jax.train.trainer import build_trainer

# What the lent GPU machine's stack is made of (it differs from this project's pins).
PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-cuda12-plugin",
    "flax",
    "optax",
    "orbax-checkpoint",
    "tokenizers",
    "safetensors",
    "numpy",
    "pyarrow",
    "tqdm",
    "tensorboardX",
    "datasets",
)
SMOKE = Qwen3Args(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=64,
    vocab_size=256,
    max_seq_len=64,
)
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")


def versions() -> dict[str, str]:
    """Python, every package of PACKAGES ('-' where absent), and JAX's devices."""
    from importlib import metadata

    found = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "-"
    found["devices"] = ", ".join(f"{d.platform}:{d.device_kind}" for d in jax.devices())
    return found


def attention_overrides(requested: str) -> tuple[list[str], str]:
    """(config overrides, what the table says) for the attention implementation `requested`."""
    if requested != "default":
        try:
            load_config(None, ["--model.attention", requested])
            return ["--model.attention", requested], requested
        except ConfigError as error:
            print(f"attention: using the model's default; {error}", flush=True)
            return [], f"default (config rejects model.attention={requested})"
    return [], "default"


def measure(
    flavor: str, batch: int, seq: int, warmup: int, steps: int, ac: str, overrides: list[str]
) -> dict[str, Any]:
    """Times one flavour's whole step at `batch` x `seq` tokens on the first device."""
    # "smoke" is SMOKE's shape passed as model_args; the flavour named in the config then only
    # labels the run.
    config = load_config(
        None,
        [
            "--model.flavor",
            "debugmodel" if flavor == "smoke" else flavor,
            "--training.local_batch_size",
            str(batch),
            "--training.seq_len",
            str(seq),
            "--training.mixed_precision_param",
            "auto",
            "--activation_checkpoint.mode",
            ac,
            "--lr_scheduler.warmup_steps",
            "1",
            *overrides,
        ],
    )
    device = jax.devices()[0]
    trainer = build_trainer(config, [device], model_args=SMOKE if flavor == "smoke" else None)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, trainer.plan.model.args.vocab_size, (batch, seq + 1)).astype(np.int32)
    data = trainer.batches.put({"inputs": tokens[:, :-1], "labels": tokens[:, 1:]})
    start = time.perf_counter()
    compiled = trainer.lower_step(trainer.abstract_state(), data).compile()
    compile_s = time.perf_counter() - start
    estimate = compiled.memory_analysis()
    state = trainer.init_state()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, data)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    dtype = np.dtype(trainer.options.param_dtype).name
    # A GPU's published bf16 peak; on CPU (--smoke) a matmul peak measured in the compute dtype.
    peak = peak_flops_per_device(device, dtype)
    flops = trainer.plan.flops_per_token() * trainer.plan.tokens_per_step
    mem = memory_stats()
    return {
        "model": flavor,
        "dtype": dtype,
        "activation_checkpoint": ac,
        "batch": batch,
        "seq_len": seq,
        "tokens_per_step": trainer.plan.tokens_per_step,
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "compile_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": trainer.plan.tokens_per_step / step_s,
        "model_tflops_per_s": flops / step_s / 1e12,
        "mfu_pct": 100 * flops / step_s / peak.flops_per_device,
        "peak_flops": peak.flops_per_device,
        "peak_flops_source": peak.source,
        "peak_memory_gib": mem["peak_bytes"] / 2**30,
        "memory_source": mem["source"],
        "compiled_args_plus_temps_gib": (
            estimate.argument_size_in_bytes + estimate.temp_size_in_bytes
        )
        / 2**30,
        "loss": float(metrics["loss"]),
    }


@dataclasses.dataclass
class Plan:
    models: list[str]
    batch: int
    seq_len: int
    warmup: int
    steps: int
    ac: str
    attention: str
    budget_s: float


def run_isolated(
    plan: Plan, model: str, batch: int, overrides: list[str], timeout_s: float
) -> dict[str, Any]:
    """measure() in a fresh process: its memory peak is its own, its crash is its row's."""
    cmd = [
        sys.executable,
        __file__,
        "--one",
        model,
        "--batch",
        str(batch),
        "--seq-len",
        str(plan.seq_len),
        "--warmup",
        str(plan.warmup),
        "--steps",
        str(plan.steps),
        "--ac",
        plan.ac,
        "--overrides",
        json.dumps(overrides),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"model": model, "batch": batch, "error": f"timed out after {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    return {"model": model, "batch": batch, "error": f"exit {proc.returncode}: {tail}"}


def run_plan(plan: Plan, write: Any) -> list[dict[str, Any]]:
    """Every model of `plan`, halving the batch after an OOM; `write(rows)` after each row."""
    overrides, attention = attention_overrides(plan.attention)
    deadline = time.monotonic() + plan.budget_s
    rows: list[dict[str, Any]] = []
    for model in plan.models:
        batch = plan.batch
        while True:
            left = deadline - time.monotonic()
            if left < 30:
                rows.append(
                    {
                        "model": model,
                        "batch": batch,
                        "error": f"skipped: the {plan.budget_s:.0f} s budget is spent",
                    }
                )
                break
            print(f"{model}: batch {batch} x {plan.seq_len}, attention {attention} ...", flush=True)
            row = run_isolated(plan, model, batch, overrides, left)
            row["attention"] = attention
            rows.append(row)
            write(rows)
            print(
                f"{model}: "
                + (
                    f"{row['tokens_per_s']:,.0f} tokens/s, MFU "
                    f"{row['mfu_pct']:.1f}%, peak {row['peak_memory_gib']:.1f} GiB"
                    if "error" not in row
                    else row["error"]
                ),
                flush=True,
            )
            if "error" in row and any(m in row["error"] for m in OOM_MARKERS) and batch > 1:
                batch //= 2
                continue
            break
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "error" not in r]
    head = ""
    if ok:
        r = ok[0]
        head = (
            f"{r['device_kind']}, jax {r['jax']}, compute {r['dtype']} (fp32 master weights "
            f"and AdamW state), activation_checkpoint={r['activation_checkpoint']}, median "
            f"step after warm-up. MFU peak: {r['peak_flops'] / 1e12:.4g} TFLOP/s "
            f"({r['peak_flops_source']}).\n\n"
        )
    lines = [
        "| model | batch x seq | attention | compile (s) | step (s) | tokens/s | "
        "model TFLOP/s | MFU | peak memory (GiB) | XLA estimate (GiB) |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        if "error" in r:
            error = r["error"].splitlines()[-1] if r["error"] else ""
            lines.append(
                f"| {r['model']} | {r['batch']} | {r.get('attention', '')} | "
                f"failed: {error[:160]} |||||||"
            )
            continue
        lines.append(
            f"| {r['model']} | {r['batch']} x {r['seq_len']} | {r['attention']} | "
            f"{r['compile_s']:.1f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['model_tflops_per_s']:.4g} | {r['mfu_pct']:.1f}% | {r['peak_memory_gib']:.2f} | "
            f"{r['compiled_args_plus_temps_gib']:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="0.6B,1.7B,debugmodel_moe", help="comma-separated Qwen3 flavours"
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (halved on OOM)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ac", default="selective", choices=["none", "full", "selective"])
    parser.add_argument(
        "--attention",
        default="cudnn",
        help="model.attention to ask for when the config has it ('default': never)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=480, help="stop starting rows after this many seconds"
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "outputs/gpu",
        help="results folder (default: $OUT, else outputs/gpu)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, 2 x 32 tokens, 1 + 2 steps, default attention: "
        "checks the path on any device",
    )
    parser.add_argument(
        "--versions",
        action="store_true",
        help="print the versions and devices; exit 1 without a GPU",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process of run_isolated
    parser.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.versions:
        found = versions()
        print("\n".join(f"{k}: {v}" for k, v in found.items()), flush=True)
        if "gpu:" not in found["devices"] and "cuda:" not in found["devices"]:
            raise SystemExit(1)
        return []
    if opts.one:
        row = measure(
            opts.one,
            opts.batch,
            opts.seq_len,
            opts.warmup,
            opts.steps,
            opts.ac,
            json.loads(opts.overrides),
        )
        print(json.dumps(row))
        return [row]
    if opts.smoke:
        plan = Plan(
            ["smoke"],
            2,
            32,
            min(opts.warmup, 1),
            min(opts.steps, 2),
            opts.ac,
            "default",
            opts.budget_s,
        )
    else:
        plan = Plan(
            opts.models.split(","),
            opts.batch,
            opts.seq_len,
            opts.warmup,
            opts.steps,
            opts.ac,
            opts.attention,
            opts.budget_s,
        )
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu_bench-{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}"

    def write(rows: list[dict[str, Any]]) -> None:
        write_text_atomic(stem.with_suffix(".json"), json.dumps(rows, indent=1) + "\n")
        write_text_atomic(stem.with_suffix(".md"), markdown(rows))

    rows = run_plan(plan, write)
    print(markdown(rows))
    print(f"results: {stem}.json, {stem}.md")
    return rows


if __name__ == "__main__":
    main()
