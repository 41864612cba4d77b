"""Train-step throughput and MFU: titan-jax's jitted whole step vs PyTorch vs MaxText, side by side.

For each model shape and batch size, times `Trainer.step_fn` (fp32, one device); when torch and
transformers are installed, the same step in PyTorch (HF Qwen3ForCausalLM, AdamW, clipping);
and when `.venv-maxtext` exists (`make bench-deps`), MaxText's own trainer on the same shape
(maxtext_bench.py). Reports medians over timed steps after warm-up, tokens/s, MFU against the
matmul peak of this machine measured at start, and titan-jax's speed relative to each. It prints
the table; `--write FILE` (`make bench-update`) also replaces the table between the markers in FILE.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from maxtext_bench import HOW_TO_ADD, maxtext_python, time_maxtext

from titan_jax.atomic_dir import write_text_atomic
from titan_jax.config import load_config
from titan_jax.models.qwen3 import Qwen3Args, get_flavor
from titan_jax.models.qwen3.flops import count_params, flops_per_token
from titan_jax.models.qwen3.hf_config import hf_config_from_args
from titan_jax.tools.cpu_allocator import preloaded_allocator
from titan_jax.train.peak_flops import peak_flops_per_device
from titan_jax.train.trainer import build_trainer

# torch (imported later) reads this once: its idle OpenMP workers otherwise spin on the 2 cores
# that the next row's JAX step needs (tests/conftest.py sets the same).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# ~100M parameters: GPT-2-small width with Qwen3's structure (GQA, QK-norm, SwiGLU), untied.
QWEN3_100M = Qwen3Args(
    dim=768,
    n_layers=12,
    n_heads=12,
    n_kv_heads=4,
    head_dim=64,
    hidden_dim=3072,
    vocab_size=2048,
    tie_embeddings=False,
)
SHAPES = {
    "debugmodel": get_flavor("debugmodel"),
    "qwen3-100M": QWEN3_100M,
    "debugmodel_moe": get_flavor("debugmodel_moe"),
}
DEFAULT_MODELS = "debugmodel,qwen3-100M"  # the MoE row has no MaxText column: --models to add it
BEGIN, END = "<!-- bench_step:begin -->", "<!-- bench_step:end -->"


@dataclasses.dataclass
class Result:
    name: str
    params_m: float
    batch: int
    tokens: int
    jax_s: float
    torch_s: float | None
    maxtext_s: float | None
    flops_per_step: float


def time_jax(args: Qwen3Args, batch: int, seq: int, warmup: int, steps: int, ac: str) -> float:
    config = load_config(
        None,
        [
            "--training.local_batch_size",
            str(batch),
            "--training.seq_len",
            str(seq),
            "--activation_checkpoint.mode",
            ac,
            "--lr_scheduler.warmup_steps",
            "1",
        ],
    )
    trainer = build_trainer(config, jax.devices()[:1], model_args=args)
    state = trainer.init_state()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab_size, (batch, seq + 1)).astype(np.int32)
    data = trainer.batches.put({"inputs": tokens[:, :-1], "labels": tokens[:, 1:]})
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = trainer.step_fn(state, data)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_torch(args: Qwen3Args, batch: int, seq: int, warmup: int, steps: int) -> float | None:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    torch.manual_seed(0)
    config = hf_config_from_args(args)  # Qwen3Config, or Qwen3MoeConfig for MoE flavours
    hf = AutoConfig.for_model(config.pop("model_type"), **config, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(hf).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cells(step_s: float | None, r: Result, peak: float) -> str:
    """Step time, tokens/s and MFU of one framework's column."""
    if step_s is None:
        return "n/a | n/a | n/a"
    mfu = 100 * r.flops_per_step / step_s / peak
    return f"{step_s:.3f} | {r.tokens / step_s:,.0f} | {mfu:.1f}%"


def markdown(
    results: list[Result], peak: float, peak_desc: str, seq: int, ac: str, notes: list[str]
) -> str:
    lines = [
        f"Measured {datetime.date.today()} on {platform.processor() or platform.machine()}, "
        f"jax {jax.__version__}, 1 CPU device, fp32, sequences of {seq} tokens, titan-jax "
        f"activation_checkpoint={ac}. Medians of timed steps after warm-up. MFU: model FLOP/s "
        f"(TorchTitan's formula, the same for all three) over {peak / 1e9:.0f} GFLOP/s "
        f"({peak_desc}). Speed ratios: titan-jax tokens/s over the other's.",
        *notes,
        "",
        "| model | batch | params | titan-jax step (s) | tokens/s | MFU | PyTorch step (s) | "
        "tokens/s | MFU | MaxText step (s) | tokens/s | MFU | titan-jax / PyTorch | "
        "titan-jax / MaxText |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    for r in results:
        ratios = " | ".join(
            "n/a" if other is None else f"{other / r.jax_s:.2f}x"
            for other in (r.torch_s, r.maxtext_s)
        )
        columns = " | ".join(_cells(s, r, peak) for s in (r.jax_s, r.torch_s, r.maxtext_s))
        lines.append(
            f"| {r.name} | {r.batch} x {r.tokens // r.batch} | {r.params_m:.1f}M | "
            f"{columns} | {ratios} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", default="4,8", help="comma-separated batch sizes (default 4,8)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps first (MaxText needs >= 2: maxtext_bench.py)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-maxtext", action="store_true")
    parser.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help=f"comma-separated shapes to time, of {', '.join(SHAPES)} (default: {DEFAULT_MODELS})",
    )
    parser.add_argument("--write", help="markdown file whose bench_step table is replaced")
    opts = parser.parse_args()
    unknown = sorted(set(opts.models.split(",")) - set(SHAPES))
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(SHAPES)}")
    try:
        batches = [int(b) for b in opts.batch.split(",")]
    except ValueError:
        parser.error(f"--batch: {opts.batch!r} is not a comma-separated list of integers")

    # `make bench` preloads tcmalloc or mimalloc (titan_jax/tools/cpu_allocator.py); PyTorch
    # runs in this process, so both columns get the same allocator. MaxText's subprocess
    # inherits it.
    allocator = preloaded_allocator()
    notes = [f"Allocator: {Path(allocator).name if allocator else 'glibc malloc'} (all columns)."]
    maxtext = None if opts.no_maxtext else maxtext_python()
    if maxtext is None and not opts.no_maxtext:
        print(HOW_TO_ADD, flush=True)
        notes.append(f"{HOW_TO_ADD}.")
    peak = peak_flops_per_device(jax.devices()[0], "float32")
    results = []
    for name in opts.models.split(","):
        args = SHAPES[name]
        for batch in batches:
            tokens = batch * opts.seq_len
            times = {
                "titan-jax": time_jax(args, batch, opts.seq_len, opts.warmup, opts.steps, opts.ac)
            }
            if not opts.no_torch:
                times["PyTorch"] = time_torch(args, batch, opts.seq_len, opts.warmup, opts.steps)
            if maxtext is not None and not args.is_moe:
                times["MaxText"] = time_maxtext(
                    args, batch, opts.seq_len, opts.warmup, opts.steps, maxtext
                )
            results.append(
                Result(
                    name,
                    count_params(args)["total"] / 1e6,
                    batch,
                    tokens,
                    times["titan-jax"],
                    times.get("PyTorch"),
                    times.get("MaxText"),
                    flops_per_token(args, opts.seq_len) * tokens,
                )
            )
            print(
                f"{name} batch {batch}: "
                + ", ".join(
                    f"{k} step {'n/a' if v is None else f'{v:.3f} s'}" for k, v in times.items()
                ),
                flush=True,
            )
    table = markdown(results, peak.flops_per_device, peak.source, opts.seq_len, opts.ac, notes)
    print(table)
    if opts.write:
        write_table(Path(opts.write), table)
        print(f"table written to {opts.write}")


def write_table(path: Path, table: str) -> None:
    """Replaces the text between the bench_step markers of `path` (created if absent)."""
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    block = f"{BEGIN}\n{table}\n{END}"
    write_text_atomic(
        path, re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    )


if __name__ == "__main__":
    main()
