"""What a run's sharding looks like, without running a step.

Per parameter: global shape, dtype, PartitionSpec and bytes per device. From the train step
compiled with abstract inputs: its collectives (op, element dtype, count, bytes) and per-device
memory (`memory_analysis()`).

Collectives are read twice: from the compiled HLO (what runs), and from the HLO right after the
SPMD partitioner (what the program asks for; absent where the backend writes no such dump, as
libtpu). They differ on CPU: XLA:CPU has no bf16 collectives and widens them to f32 after
partitioning, so there SimpleFSDP's bf16 all-gathers and fp32 gradient reductions show only in
the partitioned view. Counts are static: a collective inside the scanned layer body counts
once, though it runs once per layer.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from titan_jax.data.windows import batch_layout
from titan_jax.planner import hlo_stats
from titan_jax.planner.collectives import collectives
from titan_jax.train.trainer import Trainer
from titan_jax.trees import named_leaves

MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "peak_memory_in_bytes",
)


def _nbytes(dtype: jnp.dtype | str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def leaf_bytes_per_device(x: jax.ShapeDtypeStruct) -> int:
    return _nbytes(x.dtype, x.sharding.shard_shape(x.shape))


def param_table(trainer: Trainer) -> list[dict[str, Any]]:
    """Every stored parameter: name, global shape, dtype, PartitionSpec, bytes per device."""
    params = trainer.abstract_state()["params"]
    return [
        {
            "name": name,
            "shape": list(x.shape),
            "dtype": np.dtype(x.dtype).name,
            "spec": str(tuple(x.sharding.spec)),
            "bytes_per_device": leaf_bytes_per_device(x),
        }
        for name, x in named_leaves(params).items()
    ]


def state_bytes(trainer: Trainer) -> tuple[int, int]:
    """(per-device, total) bytes of the whole train state: params, optimizer state, step."""
    leaves = jax.tree.leaves(trainer.abstract_state())
    return (
        sum(leaf_bytes_per_device(x) for x in leaves),
        sum(_nbytes(x.dtype, x.shape) for x in leaves),
    )


def collective_counts(hlo_text: str, mesh: jax.sharding.Mesh | None = None) -> list[dict[str, Any]]:
    """The step's collectives (planner/collectives.py) grouped by (op, element dtype).

    `count`: instructions; `bytes`: their result sizes per device, summed. Async `-start` ops
    count as their op (their `-done` halves are skipped); a combined op counts once per dtype.
    """
    ops = collectives(
        hlo_text,
        [] if mesh is None else list(mesh.devices.flat),
        None if mesh is None else dict(mesh.shape),
    )
    return [{k: g[k] for k in ("op", "dtype", "count", "bytes")} for g in hlo_stats.summarize(ops)]


def abstract_batch(trainer: Trainer) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch the run's stream feeds the step (its fields, shapes and dtypes from
    `batch_layout`: document masking's (B, T, 3) inputs too), as sharded abstract arrays."""
    t = trainer.plan.config.training
    return {
        k: jax.ShapeDtypeStruct(
            (trainer.plan.global_batch_size, *shape), dtype, sharding=trainer.batches.sharding
        )
        for k, (shape, dtype) in batch_layout(t.seq_len, t.document_mask).items()
    }


def compile_lowered(lowered: Any) -> tuple[Any, str | None]:
    """`lowered.compile()`, and the HLO the SPMD partitioner produced on the way (None where the
    backend does not write that dump: libtpu does not)."""
    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile(
            compiler_options={
                "xla_dump_to": dump,
                "xla_dump_hlo_pass_re": "spmd-partitioning",
                "xla_dump_disable_metadata": True,
            }
        )
        dumps = sorted(Path(dump).glob("*after_spmd-partitioning*.txt"))
        partitioned = dumps[-1].read_text() if dumps else None
    return compiled, partitioned


def compile_step(trainer: Trainer) -> tuple[Any, str | None]:
    """The train step compiled for abstract inputs, and its HLO right after SPMD partitioning."""
    return compile_lowered(trainer.lower_step(trainer.abstract_state(), abstract_batch(trainer)))


def memory(compiled: Any) -> dict[str, int]:
    stats = compiled.memory_analysis()
    return {f: int(getattr(stats, f)) for f in MEMORY_FIELDS if hasattr(stats, f)}


def inspect_trainer(trainer: Trainer, compile: bool = True) -> dict[str, Any]:
    """The report `titan-jax inspect` prints and writes as JSON."""
    params = param_table(trainer)
    state_per_device, state_total = state_bytes(trainer)
    report: dict[str, Any] = {
        "mesh": dict(trainer.plan.mesh.shape),
        "mode": trainer.plan.degrees.mode,
        "fsdp_implementation": trainer.parallelism.implementation,
        "param_dtype": np.dtype(trainer.options.param_dtype).name,
        "params": params,
        "per_device_param_bytes": sum(p["bytes_per_device"] for p in params),
        "total_param_bytes": sum(_nbytes(p["dtype"], tuple(p["shape"])) for p in params),
        "per_device_state_bytes": state_per_device,
        "total_state_bytes": state_total,
    }
    if compile:
        compiled, partitioned = compile_step(trainer)
        report["collectives"] = collective_counts(compiled.as_text(), trainer.plan.mesh)
        if partitioned is not None:
            report["partitioned_collectives"] = collective_counts(partitioned, trainer.plan.mesh)
        report["memory"] = memory(compiled)
    return report


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [
        fmt.format(*headers),
        fmt.format(*("-" * w for w in widths)),
        *(fmt.format(*r) for r in rows),
    ]


def format_report(report: dict[str, Any]) -> str:
    """A readable version of `inspect_trainer`'s report."""
    mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items())
    lines = [
        f"mesh {mesh} ({report['mode']}, fsdp_implementation="
        f"{report['fsdp_implementation']}, param dtype {report['param_dtype']})",
        "",
    ]
    lines += _table(
        ["parameter", "shape", "dtype", "spec", "per device"],
        [
            [
                p["name"],
                "x".join(map(str, p["shape"])),
                p["dtype"],
                p["spec"],
                _size(p["bytes_per_device"]),
            ]
            for p in report["params"]
        ],
    )
    lines += [
        "",
        f"params: {_size(report['per_device_param_bytes'])} per device of "
        f"{_size(report['total_param_bytes'])}; params + optimizer state: "
        f"{_size(report['per_device_state_bytes'])} per device of "
        f"{_size(report['total_state_bytes'])}",
    ]
    for key, title in (
        ("collectives", "collectives in the compiled step"),
        ("partitioned_collectives", "collectives after SPMD partitioning"),
    ):
        if key in report:
            lines += ["", f"{title} (static counts; the layer scan body counts once):"]
            lines += _table(
                ["op", "dtype", "count", "bytes"],
                [[c["op"], c["dtype"], str(c["count"]), _size(c["bytes"])] for c in report[key]],
            )
    if "memory" in report:
        lines += ["", "memory per device (compiled.memory_analysis()):"]
        lines += [
            f"  {k.removesuffix('_in_bytes')}: {_size(v)}" for k, v in report["memory"].items()
        ]
    return "\n".join(lines)
