"""MaxText's own ahead-of-time compile of the recipes `make plans` compiles for titan-jax, for the
MaxText column of the table in docs/TPU.md (`benchmarks/tpu_plans.py`).

Runs MaxText's `train_compile` from `.venv-maxtext` (`make bench-deps`: MaxText 0.2.5 on the
same jax and libtpu as ours) as a subprocess, one recipe at a time, and reads the compiled
program's `memory_analysis()` from what it prints. Nothing executes on a TPU.

`--price` also has XLA dump MaxText's compiled step and prices it with titan-jax's estimator
(`planner/hlo_cost.py`, as `titan-jax compile` prices ours: its rings from the codegen dump, a
MoE step at balanced routing), with MFU from the same analytic FLOPs as ours (the recipes are
the same Qwen3 models): two systems' programs for one slice under one cost model.

    .venv/bin/python benchmarks/maxtext_aot.py [--only NAME ...] [--price] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from maxtext_bench import HOW_TO_ADD, base_config, maxtext_python  # noqa: E402

# The recipe of each `make plans` row with a MaxText column: fp32 weights, bf16 compute, full
# remat, AdamW, synthetic data (MaxText keys; NOTES.md).
COMMON = ("dataset_type=synthetic", "packing=false", "enable_checkpointing=false",
          "enable_tensorboard=false", "steps=5", "opt_type=adamw", "weight_dtype=float32",
          "dtype=bfloat16", "remat_policy=full", "max_target_length=4096")
DENSE_8B = ("model_name=qwen3-8b", "per_device_batch_size=2", "ici_fsdp_parallelism=-1")
MOE = ("sparse_matmul=true", "per_device_batch_size=1")
RECIPES = {
    "8B v5p-8": ("compile_topology=v5p-8", *DENSE_8B),
    "8B v6e-8": ("compile_topology=v6e-8", *DENSE_8B),
    "30B-A3B v5p-16 fsdp8": ("compile_topology=v5p-16", "model_name=qwen3-30b-a3b", *MOE,
                             "ici_fsdp_parallelism=-1"),
    "30B-A3B v5p-16 ep8": ("compile_topology=v5p-16", "model_name=qwen3-30b-a3b", *MOE,
                           "ici_fsdp_parallelism=-1", "ici_expert_parallelism=8"),
    "235B-A22B v5p-256": ("compile_topology=v5p-256", "model_name=qwen3-235b-a22b", *MOE,
                          "ici_fsdp_parallelism=16", "ici_expert_parallelism=8"),
}
FIELDS = ("argument_size_in_bytes", "temp_size_in_bytes")


def memory_of(log: str) -> dict[str, int]:
    """The sizes of the `Memory analysis: ...` line `train_compile` prints."""
    line = next((x for x in log.splitlines() if x.startswith("Memory analysis:")), None)
    if line is None:
        raise RuntimeError(f"MaxText printed no memory analysis; its last lines:\n{log[-3000:]}")
    return {f: int(m[1]) for f in FIELDS if (m := re.search(rf"{f}=(\d+)", line))}


def _key(name: str, key: str) -> str:
    return next(a.split("=", 1)[1] for a in COMMON + RECIPES[name] if a.startswith(key + "="))


def price(name: str, dump: Path) -> dict[str, float]:
    """MaxText's compiled step (`dump`: its XLA dump) priced by our estimator."""
    from titan_jax.models.qwen3 import get_flavor
    from titan_jax.models.qwen3.flops import flops_per_token
    from titan_jax.planner import hlo_cost
    from titan_jax.planner.topology import compile_only_devices, parse_slice

    optimized = sorted(dump.glob("*jit_train_step*after_optimizations.txt"))
    codegen = sorted(dump.glob("*jit_train_step*after_codegen.txt"))
    if not optimized:
        raise RuntimeError(f"MaxText's compile of {name} dumped no optimized train step")
    tpu = parse_slice(_key(name, "compile_topology"))
    n = len(compile_only_devices(tpu))  # JAX's devices (tpu7x: two a chip)
    args = get_flavor(name.split()[0])
    seq = int(_key(name, "max_target_length"))
    per_device = int(_key(name, "per_device_batch_size"))
    routed = per_device * seq * args.top_k if args.num_experts else None
    cost = hlo_cost.estimate(optimized[-1].read_text(), tpu.chip, n,
                             hlo_cost.rings(codegen[-1].read_text()) if codegen else None,
                             tpu.ring_wraps, routed)
    analytic = flops_per_token(args, seq) * per_device * seq * n
    return {"est_step_time_s": cost["step_s"], "est_compute_s": cost["compute_s"],
            "est_exposed_collective_s": cost["exposed_collective_s"],
            "est_hbm_bytes_per_chip": cost["hbm_bytes_per_chip"],
            "est_seconds_by_class": cost["seconds_by_class"],
            "est_mfu_pct": 100 * analytic / (n * tpu.chip.peak_bf16_flops * cost["step_s"])}


def compile_recipe(python: Path, name: str, priced: bool = False) -> dict[str, float | str]:
    with tempfile.TemporaryDirectory() as out:
        command = [str(python), "-m", "maxtext.trainers.pre_train.train_compile",
                   str(base_config(python)), f"run_name={name.replace(' ', '_')}",
                   f"base_output_directory={out}", "compile_topology_num_slices=1",
                   *COMMON, *RECIPES[name]]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        dump = Path(out) / "xla_dump"
        if priced:
            env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                                "--xla_dump_hlo_module_re=jit_train_step").strip()
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        log = done.stdout + done.stderr
        if done.returncode:
            raise RuntimeError(f"MaxText's compile of {name} failed:\n{log[-3000:]}")
        return {"recipe": name, "compile_s": round(seconds, 1),
                **{f: v / 1e9 for f, v in memory_of(log).items()},
                **(price(name, dump) if priced else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(RECIPES))
    parser.add_argument("--price", action="store_true",
                        help="also price MaxText's compiled step with titan-jax's estimator")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    opts = parser.parse_args()
    python = maxtext_python()
    if python is None:
        print(HOW_TO_ADD)
        return 2
    rows = []
    for name in opts.only or RECIPES:
        row = compile_recipe(python, name, opts.price)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
