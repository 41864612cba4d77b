"""Compile time of the whole train step: Qwen3-0.6B at its 28 layers vs the same model at 8.

Layers are stacked and run by one `lax.scan`, so the step's program holds one layer body
whatever the depth: lowering and compiling 28 layers should cost about what 8 cost
(`tests/train/test_compile_size.py` guards the reason: the StableHLO text does not grow with
`n_layers`). For each target, lowers the step with abstract inputs (nothing is allocated) and
compiles it, timing both, `--repeats` times in alternating order (medians):
- `cpu`: one CPU device of this host, fp32;
- `tpu`: a TPU v5p:2x2x2 (8 chips, FSDP 8) compiled ahead of time with libtpu, bf16 params.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import time
from pathlib import Path

import jax

from titan_jax.config import load_config
from titan_jax.models.qwen3 import get_flavor
from titan_jax.planner import inspect_step
from titan_jax.train.trainer import build_trainer

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "qwen3_0.6b.toml"
TARGETS = ("cpu", "tpu")


def target_setup(target: str, seq_len: int) -> tuple[list[jax.Device], list[str]]:
    """(devices, config overrides) of a target."""
    if target == "cpu":
        return jax.devices("cpu")[:1], [
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.local_batch_size",
            "1",
            "--training.seq_len",
            str(seq_len),
            "--training.mixed_precision_param",
            "float32",
        ]
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    return list(topology.devices), [
        "--parallelism.data_parallel_shard_degree",
        "8",
        "--training.local_batch_size",
        "1",
        "--training.seq_len",
        str(seq_len),
        "--training.mixed_precision_param",
        "bfloat16",
    ]


def measure(target: str, n_layers: int, seq_len: int, ac: str) -> tuple[float, float, int]:
    """(lowering s, compile s, StableHLO characters) of one fresh step."""
    devices, overrides = target_setup(target, seq_len)
    config = load_config(RECIPE, [*overrides, "--activation_checkpoint.mode", ac])
    args = dataclasses.replace(get_flavor("0.6B"), n_layers=n_layers)
    trainer = build_trainer(config, devices, model_args=args)
    state, batch = trainer.abstract_state(), inspect_step.abstract_batch(trainer)
    t0 = time.perf_counter()
    lowered = trainer.lower_step(state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(lowered.as_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}"
    )
    parser.add_argument("--layers", default="28,8", help="comma-separated layer counts")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--ac", default="selective", help="activation_checkpoint.mode")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    targets = opts.targets.split(",")
    if unknown := sorted(set(targets) - set(TARGETS)):
        parser.error(f"--targets: unknown {', '.join(unknown)}; valid: {', '.join(TARGETS)}")
    layers = [int(n) for n in opts.layers.split(",")]

    rows = []
    for target in targets:
        runs: dict[int, list[tuple[float, float, int]]] = {n: [] for n in layers}
        for _ in range(opts.repeats):  # alternate depths so load on the host hits both alike
            for n in layers:
                runs[n].append(measure(target, n, opts.seq_len, opts.ac))
                print(
                    f"{target} {n} layers: lower {runs[n][-1][0]:.2f} s, compile "
                    f"{runs[n][-1][1]:.2f} s",
                    flush=True,
                )
        for n in layers:
            lower, compile_, chars = (statistics.median(x) for x in zip(*runs[n], strict=True))
            rows.append(
                f"| {target} | {n} | {lower:.2f} | {compile_:.2f} | "
                f"{lower + compile_:.2f} | {chars / 1e3:,.0f}k |"
            )
    print(
        f"\nMeasured {datetime.date.today()} on {platform.machine()}, jax {jax.__version__}, "
        f"Qwen3-0.6B step (seq {opts.seq_len}, activation_checkpoint={opts.ac}), medians of "
        f"{opts.repeats}:\n"
    )
    print("| target | layers | lower (s) | compile (s) | total (s) | StableHLO chars |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
