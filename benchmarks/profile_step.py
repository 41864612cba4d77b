"""Where the CPU train step's time goes: a per-op profile of the compiled step.

Runs the whole jitted step (one CPU device, fp32) under `jax.profiler`, reads the trace back
(`jax.profiler.ProfileData`): XLA:CPU records one event per executed thunk (a fusion, a dot, a
copy, a loop), named after its HLO instruction. Each event's self time (its duration less the
thunks nested in it, e.g. a while loop's body) is charged to its instruction, and each
instruction to a (phase, part) by the `op_name` metadata of the compiled HLO:
- phase: `forward` (under `jvp`), `backward` (under `transpose`), `optimizer` (the rest of
  the step: clipping, AdamW, finite guard), or `unknown` (XLA:CPU's matmul fusions lose their
  metadata: outside the layer loop, i.e. the output head's forward and backward matmuls);
- part: the innermost named scope the model and step set (`sdpa` = causal_gqa_attention,
  `project` in `attention` or `feed_forward`, `rms_norm`, `rope`, `swiglu`, `embed`, `loss`),
  or `other` (residual adds, layout copies, the scan's stacking of per-layer values and
  gradients). Matmul fusions carry no metadata on XLA:CPU: they are named by where they run
  (inside the layer scan or not) and by their shapes (`_dot_part`).
Shares are of the summed thunk time; on a shared machine they are steadier than seconds.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from titan_jax.config import load_config
from titan_jax.models.qwen3 import Qwen3Args, get_flavor
from titan_jax.train.trainer import Trainer, build_trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import QWEN3_100M  # noqa: E402

SHAPES = {
    "debugmodel": get_flavor("debugmodel"),
    "qwen3-100M": QWEN3_100M,
    "debugmodel_moe": get_flavor("debugmodel_moe"),
}
DEFAULT_MODELS = "debugmodel,qwen3-100M"
PARTS = ("sdpa", "rope", "rms_norm", "swiglu", "embed", "loss", "router", "experts", "moe_permute")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)")


def classify(op_name: str) -> tuple[str, str]:
    """(phase, part) of an HLO instruction from its op_name (see the module docstring)."""
    phase = (
        "backward"
        if "transpose(" in op_name
        else "forward"
        if "jvp(" in op_name
        else "unknown"
        if op_name == "unknown"
        else "optimizer"
    )
    scopes = op_name.split("/")
    for scope in reversed(scopes):
        if scope in PARTS:
            return phase, scope
        if scope == "project":
            owner = "attention" if "attention" in scopes else "feed_forward"
            return phase, f"{owner} matmuls"
    return phase, "other"


def _dot_part(fused: list[str], in_layer_loop: bool, args: Qwen3Args) -> str:
    """XLA:CPU's matmul fusions (`ynn_fusion`) lose their metadata: name the matmul by where it
    runs (the layer scan's body or not) and by shape."""
    if not in_layer_loop:
        return "loss"  # the output head (the embedding's gather is no dot)
    if any(" dot(" in line and "lhs_batch_dims" in line for line in fused):
        return "sdpa"  # the batched score and value einsums
    dims = {
        int(d)
        for line in fused
        for shape in re.findall(r"\[([0-9,]*)\]", line)
        for d in shape.split(",")
        if d
    }
    if args.is_moe and args.moe_inter_dim in dims:
        return "experts"
    if args.is_moe and args.num_experts in dims:
        return "router"
    return "feed_forward matmuls" if args.hidden_dim in dims else "attention matmuls"


def instruction_classes(hlo_text: str, args: Qwen3Args) -> dict[str, tuple[str, str]]:
    """Every instruction of the compiled step -> (phase, part). One without metadata takes the
    phase of the instruction that calls its computation (a loop body takes its loop's)."""
    computations: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = computations.setdefault(m[1], [])
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _LINE.match(line)):
            current.append((m[1], m[2]))
    caller_op: dict[str, str] = {}
    for body in computations.values():  # twice: nested calls inherit through their callers
        for _, rest in body:
            op = _OP_NAME.search(rest)
            for callee in _CALLS.findall(rest):
                if op:
                    caller_op[callee] = op[1]
    for _ in range(2):
        for name, body in computations.items():
            for _, rest in body:
                for callee in _CALLS.findall(rest):
                    if callee not in caller_op and name in caller_op:
                        caller_op[callee] = caller_op[name]
    in_loop = {
        callee
        for body in computations.values()
        for _, rest in body
        if " while(" in rest
        for callee in _CALLS.findall(rest)
    }
    for _ in range(3):  # computations called from a loop body run in the loop too
        in_loop |= {
            callee
            for name in list(in_loop)
            for _, rest in computations.get(name, [])
            for callee in _CALLS.findall(rest)
        }
    classes = {}
    for name, body in computations.items():
        for inst, rest in body:
            op = _OP_NAME.search(rest)
            phase, part = classify(op[1] if op else caller_op.get(name, "unknown"))
            fused = [
                line for callee in _CALLS.findall(rest) for _, line in computations.get(callee, [])
            ]
            if " dot(" in rest or any(" dot(" in line for line in fused):
                part = _dot_part([rest, *fused], name in in_loop, args)
            classes[inst] = (phase, part)
    return classes


def self_times(trace_folder: str) -> dict[str, float]:
    """Summed self time (s) of each thunk name over every thread of the trace."""
    files = sorted(Path(trace_folder).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    totals: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            events = sorted(
                ((e.start_ns, e.duration_ns, e.name) for e in line.events),
                key=lambda e: (e[0], -e[1]),
            )
            stack: list[list] = []  # [end_ns, name, self_ns]
            for start, duration, name in events:
                while stack and stack[-1][0] <= start:
                    _, done, own = stack.pop()
                    totals[done.removeprefix("end: ")] += own / 1e9
                if stack:
                    stack[-1][2] -= duration
                stack.append([start + duration, name, duration])
            for _, done, own in stack:
                totals[done.removeprefix("end: ")] += own / 1e9
    return totals


def setup(args: Qwen3Args, batch: int, seq: int, ac: str) -> tuple[Trainer, object, object]:
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
    tokens = np.random.default_rng(0).integers(0, args.vocab_size, (batch, seq + 1))
    data = trainer.batches.put(
        {"inputs": tokens[:, :-1].astype(np.int32), "labels": tokens[:, 1:].astype(np.int32)}
    )
    return trainer, trainer.init_state(), data


def profile(name: str, batch: int, seq: int, ac: str, steps: int) -> str:
    trainer, state, data = setup(SHAPES[name], batch, seq, ac)
    names = instruction_classes(trainer.lower_step(state, data).compile().as_text(), SHAPES[name])
    state, metrics = trainer.step_fn(state, data)  # compile and warm up
    jax.block_until_ready(metrics)
    walls = []
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            t0 = time.perf_counter()
            state, metrics = trainer.step_fn(state, data)
            jax.block_until_ready(metrics)
            walls.append(time.perf_counter() - t0)
        jax.profiler.stop_trace()
        times = self_times(folder)
    table: dict[tuple[str, str], float] = collections.defaultdict(float)
    ops: dict[str, float] = collections.defaultdict(float)
    for thunk, seconds in times.items():
        if thunk in names:
            table[names[thunk]] += seconds
            ops[thunk] += seconds
    total = sum(table.values())
    phases = ("forward", "backward", "optimizer", "unknown")
    parts = sorted({p for _, p in table}, key=lambda p: -sum(table[(f, p)] for f in phases))
    lines = [
        f"{name}: batch {batch} x {seq}, activation_checkpoint={ac}, {steps} traced "
        f"steps, median step {statistics.median(walls):.2f} s wall, thunk time "
        f"{total / steps:.2f} s/step (both cores)",
        "",
        "| part | " + " | ".join(phases) + " | total |",
        "|---|---|---|---|---|---|",
    ]
    for part in parts:
        cells = [100 * table[(f, part)] / total for f in phases]
        lines.append(
            f"| {part} | " + " | ".join(f"{c:.1f}%" for c in cells) + f" | {sum(cells):.1f}% |"
        )
    cells = [100 * sum(v for (f, _), v in table.items() if f == phase) / total for phase in phases]
    lines.append("| **all** | " + " | ".join(f"{c:.1f}%" for c in cells) + " | 100% |")
    lines += ["", "Top instructions:", ""]
    for thunk, seconds in sorted(ops.items(), key=lambda kv: -kv[1])[:10]:
        phase, part = names[thunk]
        lines.append(f"- {100 * seconds / total:.1f}% `{thunk}` ({phase}, {part})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help=f"comma-separated, of {', '.join(SHAPES)} (default {DEFAULT_MODELS})",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ac", default="none", help="activation_checkpoint.mode")
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()
    if unknown := sorted(set(opts.models.split(",")) - set(SHAPES)):
        parser.error(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(SHAPES)}")
    for name in opts.models.split(","):
        print(profile(name, opts.batch, opts.seq_len, opts.ac, opts.steps) + "\n", flush=True)


if __name__ == "__main__":
    main()
