"""The MaxText column of bench_step.py: the same model shape trained by MaxText 0.2.5, in its own
venv (`make bench-deps`: on our jax and libtpu, beside its far larger dependency tree), as a
subprocess.

MaxText prints one line per step (`completed step: N, seconds: S, TFLOP/s/device: ...`); the
median of the step times after warm-up is its figure. Recipe choices (documented in
BENCHMARKS.md): fp32 weights and compute, plain dot-product attention, synthetic data, and
`remat_policy=minimal_with_context`, the least rematerialisation MaxText offers.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from titan_jax.models.qwen3 import Qwen3Args

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-maxtext"
HOW_TO_ADD = "MaxText column: n/a (no .venv-maxtext; add it with `make bench-deps`, ~5 min)"
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def maxtext_python(venv: Path = VENV) -> Path | None:
    """The MaxText venv's interpreter, or None when the venv is absent."""
    python = venv / "bin" / "python"
    return python if python.exists() else None


def base_config(python: Path) -> Path:
    """MaxText's configs/base.yml inside its venv (found without importing MaxText)."""
    out = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u; "
            "print(u.find_spec('maxtext').submodule_search_locations[0])",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip()) / "configs" / "base.yml"


def maxtext_command(
    python: Path,
    base_yml: Path,
    args: Qwen3Args,
    batch: int,
    seq: int,
    steps: int,
    output_dir: Path,
) -> list[str]:
    """The MaxText pre-training command for `args` at `batch` x `seq` tokens, fp32, on one CPU."""
    if args.is_moe:
        raise ValueError("the MaxText column times dense Qwen3 shapes only")
    overrides = {
        "run_name": "bench",
        "base_output_directory": output_dir,
        # qwen3-0.6b supplies the Qwen3 block (QK-norm, SwiGLU, GQA); the shape is overridden.
        "model_name": "qwen3-0.6b",
        "override_model_config": "true",
        "base_emb_dim": args.dim,
        "base_num_decoder_layers": args.n_layers,
        "base_num_query_heads": args.n_heads,
        "base_num_kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "base_mlp_dim": args.hidden_dim,
        "vocab_size": args.vocab_size,
        "logits_via_embedding": str(args.tie_embeddings).lower(),
        "normalization_layer_epsilon": args.norm_eps,
        "rope_max_timescale": int(args.rope_theta),
        # hardware=cpu alone would call jax.distributed.initialize with XPK's env variables.
        "hardware": "cpu",
        "skip_jax_distributed_system": "true",
        "dataset_type": "synthetic",
        "attention": "dot_product",
        "remat_policy": "minimal_with_context",
        "weight_dtype": "float32",
        "dtype": "float32",
        "per_device_batch_size": batch,
        "max_target_length": seq,
        "steps": steps,
        "enable_checkpointing": "false",
        "enable_tensorboard": "false",
    }
    return [
        str(python),
        "-m",
        "maxtext.trainers.pre_train.train",
        str(base_yml),
        *(f"{key}={value}" for key, value in overrides.items()),
    ]


def parse_step_times(log: str) -> dict[int, float]:
    """Step number -> seconds, from MaxText's `completed step` lines."""
    return {int(step): float(seconds) for step, seconds in STEP_LINE.findall(log)}


def median_after_warmup(times: dict[int, float], warmup: int, steps: int) -> float:
    """Median of the `steps` step times after the first `warmup`. MaxText times a step from one
    loop iteration to the next while dispatch runs ahead, so step 1 shows only its dispatch and
    step 2 waits for both: warm-up should be at least 2."""
    timed = [times[s] for s in sorted(times) if s >= warmup]
    if len(timed) < steps:
        raise ValueError(
            f"MaxText logged {len(timed)} steps after {warmup} warm-up steps, expected {steps}"
        )
    return statistics.median(timed)


def time_maxtext(
    args: Qwen3Args, batch: int, seq: int, warmup: int, steps: int, python: Path
) -> float | None:
    """Median MaxText step time, or None (with the log's tail printed) if the run failed."""
    workdir = Path(tempfile.mkdtemp(prefix="bench_maxtext_"))
    cmd = maxtext_command(
        python, base_config(python), args, batch, seq, warmup + steps, workdir / "out"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # One CPU device, as for the titan-jax and PyTorch columns.
    env["XLA_FLAGS"] = " ".join(
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (workdir / "maxtext.log").write_text(log)
    try:
        if proc.returncode:
            raise ValueError(f"exit status {proc.returncode}")
        median = median_after_warmup(parse_step_times(log), warmup, steps)
        shutil.rmtree(workdir)  # kept, log included, only when the run failed
        return median
    except ValueError as error:
        tail = "\n".join(log.splitlines()[-15:])
        print(f"MaxText run failed ({error}); log: {workdir / 'maxtext.log'}\n{tail}", flush=True)
        return None
