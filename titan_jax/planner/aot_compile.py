"""`titan-jax compile`: the exact train step compiled ahead of time for a named TPU slice, from a
CPU host, to plan a pod job before paying for one.

Reports per-chip memory from the compiled program and whether it fits as XLA:TPU decides it
(the program's peak of live buffers, arguments included, against the HBM the compiler says it
can use), the largest buffers, FLOPs per step (analytic, and the program's matmuls, grouped
matmuls and splash kernels weighted by loop trip counts), the collectives of the compiled HLO
and how much of each in-loop all-gather the schedule overlaps with compute, and two step-time
estimates: `est_*`, each compiled instruction at max(FLOPs at the bf16 peak, HBM bytes at the
HBM bandwidth) plus the collectives the schedule leaves exposed (planner/hlo_cost.py); and
`roofline_*`, compute at peak with collectives fully overlapped (an upper bound on MFU).
"""

from __future__ import annotations

import functools
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from titan_jax.config import ConfigError, JobConfig
from titan_jax.jax_platform import DEFAULT_LIBTPU_FLAGS
from titan_jax.models.spec import ModelArgs
from titan_jax.planner import calibration, hlo_cost, hlo_stats, inspect_step, kernel_flops
from titan_jax.planner.collectives import collectives
from titan_jax.planner.topology import Chip, TpuSlice, compile_only_devices, parse_slice
from titan_jax.train.trainer import Trainer, build_trainer

PROGRAM = "program.hlo.txt"  # the compiled step's text, in a kept dump
_OOM_TEMPORARIES = re.compile(r"HLO temporaries \(([0-9.]+)([GMK]?)\)")
_AVAILABLE_HBM = re.compile(r"available HBM \(([0-9.]+)([GMK]?)\)")
_UNITS = {"G": 2**30, "M": 2**20, "K": 2**10, "": 1}


def _flag_name(flag: str) -> str:
    """The name of a "--name=value" flag."""
    return flag.removeprefix("--").partition("=")[0]


# libtpu flags the compiled schedule's collective overlap depends on (their values are read
# from the compile's flag dump into the report): titan-jax's defaults, and the scheduler's.
SCHEDULER_FLAGS = (
    *map(_flag_name, DEFAULT_LIBTPU_FLAGS),
    "xla_max_concurrent_async_all_gathers",
    "xla_tpu_enable_async_collective_fusion",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
    "xla_tpu_enable_async_collective_fusion_multiple_steps",
    "xla_tpu_enable_async_collective_fusion_while_loops",
    "xla_enable_async_reduce_scatter_fusion",
    "xla_enable_async_all_reduce",
    "xla_tpu_enable_latency_hiding_scheduler",
    "xla_latency_hiding_scheduler_rerun",
)


@functools.cache
def usable_hbm_bytes(device: Any) -> int | None:
    """The HBM XLA:TPU lets one program use on `device` (v6e: 31.25 GiB of 32): read from the
    compiler's refusal of a program that cannot fit (a sort of 2^40 bytes), as the compiler
    states it; None if it does not say."""
    import jax.numpy as jnp

    big = jax.ShapeDtypeStruct(
        (1 << 17, 1 << 17), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
    )
    try:
        jax.jit(lambda x: jnp.sort(x, axis=0)[:1]).lower(big).compile()
    except jax.errors.JaxRuntimeError as e:
        if found := _AVAILABLE_HBM.search(str(e)):
            return int(float(found[1]) * _UNITS[found[2]])
    return None


def roofline(chip: Chip, flops_per_chip: float, ops: list[dict[str, Any]]) -> dict[str, float]:
    compute_s = flops_per_chip / chip.peak_bf16_flops
    ici_s = sum(c["moved_bytes_per_step"] for c in ops if c["network"] == "ici")
    dcn_s = sum(c["moved_bytes_per_step"] for c in ops if c["network"] == "dcn")
    # every ICI port sending at once: a bound no single ring reaches
    ici_s = ici_s / chip.ring_bytes_per_s(chip.ici_ports // 2)
    dcn_s = dcn_s / chip.dcn_bytes_per_s
    return {
        "compute_s": compute_s,
        "ici_s": ici_s,
        "dcn_s": dcn_s,
        "est_step_time_s": max(compute_s, ici_s + dcn_s),
    }


def _verdict(
    memory: dict[str, Any], chip: Chip, usable: int | None, accepted: bool
) -> dict[str, Any]:
    """Fit as XLA:TPU decides it: on the compiler's accept/refuse edge (docs/TPU.md) the figure
    it holds against its usable HBM is the program's peak of live buffers, arguments included
    (`peak_memory_in_bytes`; the "HLO temporaries" of its refusal message), not temporaries
    alone nor arguments + temporaries, whose buffers partly live at different times."""
    usable = usable or chip.hbm_bytes
    args_temps = memory.get("argument_size_in_bytes", 0) + memory.get("temp_size_in_bytes", 0)
    peak = memory.get("peak_memory_in_bytes", args_temps)
    return {
        "memory": memory,
        "per_chip_bytes": peak,
        "args_plus_temps_bytes": args_temps,
        "hbm_bytes": chip.hbm_bytes,
        "usable_hbm_bytes": usable,
        "fits": accepted and peak <= usable,
        "headroom_bytes": usable - peak,
    }


def _out_of_memory(
    error: Exception, chip: Chip, usable: int | None, argument_bytes: int
) -> dict[str, Any] | None:
    """The compiler's own verdict when the program cannot fit: XLA:TPU refuses to compile it
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
    temporaries (140.31G) exceeds available HBM (15.75G)"); the figure it names is the peak of
    live buffers, arguments included. Arguments are known without compiling."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text or "memory" not in text.lower():
        return None
    memory: dict[str, Any] = {"argument_size_in_bytes": argument_bytes}
    if peak := _OOM_TEMPORARIES.search(text):
        memory["peak_memory_in_bytes"] = int(float(peak[1]) * _UNITS[peak[2]])
    if available := _AVAILABLE_HBM.search(text):
        usable = int(float(available[1]) * _UNITS[available[2]])
    return {
        **_verdict(memory, chip, usable, accepted=False),
        "compiler_error": text.strip().splitlines()[0][:500],
    }


def top_buffers(report_text: str, n: int = 8) -> list[dict[str, Any]]:
    """The largest allocations of XLA's buffer-assignment report (`*memory-usage-report.txt`):
    size and the shapes of the values that share it."""
    rows = re.findall(
        r"^\s*[0-9.]+\w*\(\s*\d+%\);\s*([0-9.]+)(\w*);\s*\d+;\s*(\d+);\s*(.*)$",
        report_text,
        flags=re.M,
    )
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    found = [
        {
            "bytes": int(float(size) * units.get(unit or "B", 1)),
            "values": int(values),
            "shapes": shapes.strip()[:200],
        }
        for size, unit, values, shapes in rows
    ]
    return sorted(found, key=lambda b: -b["bytes"])[:n]


def _compile_with_dumps(
    lowered: Any, keep: Path | None = None
) -> tuple[Any, list[dict[str, Any]], dict[str, str], dict[str, tuple[int, ...]]]:
    """The compiled step, its largest buffers, the scheduler flags it was compiled with and
    the rings of each collective's algorithm (from the codegen dump). `keep`: a folder that
    keeps the dump, to re-price the program later without compiling it (`reprice`)."""
    with tempfile.TemporaryDirectory(delete=keep is None) as temporary:
        dump = str(keep or temporary)
        compiled = lowered.compile(
            compiler_options={
                "xla_dump_to": dump,
                "xla_dump_hlo_pass_re": "^$",
                "xla_dump_disable_metadata": True,
            }
        )
        reports = sorted(Path(dump).glob("*memory-usage-report.txt"))
        buffers = top_buffers(reports[-1].read_text()) if reports else []
        codegen = sorted(Path(dump).glob("*after_codegen.txt"))[-1:]
        rings = hlo_cost.rings(codegen[0].read_text()) if codegen else {}
        flags = {}
        for flagfile in sorted(Path(dump).glob("*.flagfile"))[-1:]:
            for line in flagfile.read_text().splitlines():
                name, _, value = line.removeprefix("--").partition("=")
                if name in SCHEDULER_FLAGS:
                    flags[name] = value.strip("'")
    return compiled, buffers, flags, rings


def _build(
    config: JobConfig, tpu: TpuSlice, devices: list[Any], model_args: ModelArgs | None
) -> Trainer:
    try:
        return build_trainer(config, devices, model_args=model_args)
    except ConfigError as e:
        raise ConfigError(
            f"--topology {tpu.name} x {tpu.num_slices} slice(s) = {len(devices)} devices: {e}"
        ) from None


def _flops(trainer: Trainer, lowered: Any) -> dict[str, Any]:
    """FLOPs per step of the lowered (global) program: dots, and grouped matmuls at the rows
    balanced routing fills (their buffer's shape bound beside them)."""
    # debug_info: the ops' names, which mark the conditionals' expected branches
    module = hlo_stats.parse(lowered.as_text(dialect="hlo", debug_info=True))
    dots, unknown_loops = hlo_stats.dot_flops(module)
    plan = trainer.plan
    rows = plan.expert_rows_per_step
    grouped, grouped_bound = hlo_stats.ragged_dot_flops(
        module,
        rows // plan.ep_chunks if rows else None,  # each kernel runs one chunk
        functools.partial(kernel_flops.megablox_flops, hidden_split=plan.degrees.tp),
    )
    return {
        "dot_flops_per_step": dots,
        "grouped_matmul_flops_per_step": grouped,
        "grouped_matmul_flops_bound_per_step": grouped_bound,
        "flops_loops_of_unknown_length": unknown_loops,
    }


def routed_rows(trainer: Trainer) -> int | None:
    """Rows each of a device's expert kernels covers at balanced routing: its own picks
    (tokens of one microbatch on its data-parallel rank x top_k; each rank receives as many
    as it sends), over `parallelism.expert_parallel_chunks` (each kernel runs one chunk).
    None for a dense model."""
    rows = trainer.plan.expert_rows_per_device
    return None if rows is None else rows // trainer.plan.ep_chunks


def _estimates(
    report: dict[str, Any],
    hlo: str,
    tpu: TpuSlice,
    n: int,
    mesh_devices: list[Any],
    mesh_shape: dict[str, int],
    rings: dict[str, tuple[int, ...]] | None = None,
    routed: int | None = None,
) -> dict[str, Any]:
    """Kernel FLOPs, the collectives, the predictive estimate and the roofline bound. A MoE
    step (`routed`: its rows per device at balanced routing) is estimated at balanced routing
    with the branch that takes, and bounded with every pick routed to one rank."""
    module = hlo_stats.parse(hlo)
    counts, _ = hlo_stats.executions(module)
    attention = n * sum(
        times * kernel_flops.kernel_flops(i)
        for name, times in counts.items()
        for i in module.computations[name]
        if i.name.startswith("splash")
    )
    flops = report["dot_flops_per_step"] + report["grouped_matmul_flops_per_step"] + attention
    ops = collectives(hlo, mesh_devices, mesh_shape)
    chip = tpu.chip
    cost = hlo_cost.estimate(hlo, chip, n, rings, tpu.ring_wraps, routed)
    skewed = (
        hlo_cost.estimate(hlo, chip, n, rings, tpu.ring_wraps, costlier_branches=True)
        if routed
        else None
    )
    gathers = [c for c in cost["collectives"] if c["op"] == "all-gather" and c["executions"] > 1]
    gather_s = sum(c["seconds"] * c["executions"] for c in gathers)
    covered_s = sum(min(c["covered_s"], c["seconds"]) * c["executions"] for c in gathers)
    # The analytic count also has the norm weights' 6 FLOPs per parameter, which are not
    # matmuls: take the larger, so the bound never claims more than 100%.
    bound = roofline(chip, max(flops, report["analytic_flops_per_step"]) / n, ops)
    peak = n * chip.peak_bf16_flops
    mfu = 100 * report["analytic_flops_per_step"] / (peak * cost["step_s"])
    roofline_mfu = 100 * report["analytic_flops_per_step"] / (peak * bound["est_step_time_s"])
    return {
        "attention_kernel_flops_per_step": attention,
        "flops_per_step": flops,
        "collectives": hlo_stats.summarize(
            ops, ("op", "dtype", "network", "in_layer_loop", "axes")
        ),
        "est_step_time_s": cost["step_s"],
        "est_step_time_band_s": calibration.step_band(cost["step_s"], bound["est_step_time_s"]),
        "est_compute_s": cost["compute_s"],
        "est_exposed_collective_s": cost["exposed_collective_s"],
        "est_dma_wait_s": cost["dma_wait_s"],
        "est_hbm_bytes_per_chip": cost["hbm_bytes_per_chip"],
        "est_host_transfer_bytes_per_chip": cost["host_transfer_bytes_per_chip"],
        "est_flops_loop_bodies_once": cost["flops_loop_bodies_once"],
        "est_hbm_bytes_loop_bodies_once": cost["hbm_bytes_loop_bodies_once"],
        "est_routed_rows_per_device": routed,
        "est_seconds_by_class": cost["seconds_by_class"],
        "est_conditionals": [
            {k: c[k] for k in ("name", "executions", "branch", "seconds", "expected", "others")}
            for c in cost["conditionals"]
        ],
        # none where routing moves nothing (no expert parallelism: no exchange, no fallback)
        "est_all_to_one_rank_step_time_s": (
            skewed["step_s"] if skewed and skewed["step_s"] > 1.001 * cost["step_s"] else None
        ),
        "est_mfu_pct": mfu,
        "est_mfu_band_pct": calibration.mfu_band(mfu, roofline_mfu),
        "in_loop_all_gathers": len(gathers),
        "in_loop_all_gather_s": gather_s,
        "in_loop_all_gather_overlap_pct": 100 * covered_s / gather_s if gather_s else None,
        "in_loop_all_gather_min_overlap_pct": min(
            (100 * c["overlap"] for c in gathers), default=None
        ),
        "roofline_step_time_s": bound["est_step_time_s"],
        "compute_s": bound["compute_s"],
        "ici_s": bound["ici_s"],
        "dcn_s": bound["dcn_s"],
        "roofline_mfu_pct": roofline_mfu,
    }


def compile_report(
    config: JobConfig,
    topology: str,
    num_slices: int = 1,
    model_args: ModelArgs | None = None,
    keep_dump: Path | None = None,
) -> dict[str, Any]:
    """Compile the train step for `topology` with abstract inputs and report what it costs;
    `keep_dump`: a folder that keeps the compiler's dump of it (`reprice`)."""
    tpu = parse_slice(topology, num_slices)
    devices = compile_only_devices(tpu)
    trainer = _build(config, tpu, devices, model_args)
    usable = usable_hbm_bytes(devices[0])
    start = time.perf_counter()
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    lower_s = time.perf_counter() - start
    n = len(devices)
    report: dict[str, Any] = {
        "topology": tpu.name,
        "num_slices": num_slices,
        "chips": n,
        "tpu": tpu.libtpu_name,
        "chip_source": tpu.chip.source,
        "model": f"{config.model.name} {config.model.flavor}",
        "mesh": dict(trainer.plan.mesh.shape),
        "mode": trainer.plan.degrees.mode,
        "fsdp_implementation": trainer.parallelism.implementation,
        "param_dtype": np.dtype(trainer.options.param_dtype).name,
        "activation_checkpoint": config.activation_checkpoint.mode,
        "attention": trainer.plan.attention,
        "tokens_per_step": trainer.plan.tokens_per_step,
        "analytic_flops_per_step": trainer.plan.flops_per_token() * trainer.plan.tokens_per_step,
        **_flops(trainer, lowered),
        "lower_s": lower_s,
    }
    start = time.perf_counter()
    try:
        compiled, buffers, flags, rings = _compile_with_dumps(lowered, keep_dump)
    except jax.errors.JaxRuntimeError as e:
        batch = inspect_step.abstract_batch(trainer).values()
        arguments = inspect_step.state_bytes(trainer)[0] + sum(
            inspect_step.leaf_bytes_per_device(x) for x in batch
        )
        verdict = _out_of_memory(e, tpu.chip, usable, arguments)
        if verdict is None:
            raise
        return {
            **report,
            **verdict,
            "compile_s": time.perf_counter() - start,
            "flops_per_step": report["dot_flops_per_step"],
            "collectives": [],
            "est_step_time_s": None,
            "est_mfu_pct": None,
            "roofline_step_time_s": None,
            "roofline_mfu_pct": None,
            "top_buffers": [],
            "scheduler_flags": {},
        }
    report["compile_s"] = time.perf_counter() - start
    report.update(_verdict(inspect_step.memory(compiled), tpu.chip, usable, accepted=True))
    report["top_buffers"], report["scheduler_flags"] = buffers, flags
    cost_analysis = compiled.cost_analysis()
    report["cost_analysis_flops_per_chip"] = float(cost_analysis.get("flops", 0.0))
    report["cost_analysis_bytes_per_chip"] = float(cost_analysis.get("bytes accessed", 0.0))
    program = compiled.as_text()
    if keep_dump:  # with its ops' metadata, which the dump leaves out (planner_hints' marks)
        (keep_dump / PROGRAM).write_text(program)
    report.update(
        _estimates(
            report,
            program,
            tpu,
            n,
            list(trainer.plan.mesh.devices.flat),
            dict(trainer.plan.mesh.shape),
            rings,
            routed_rows(trainer),
        )
    )
    report["quantize_mode"] = config.quantize.mode
    report.update(_low_precision_mfu(report, config.quantize.mode, tpu.chip, n))
    return report


def reprice(report: dict[str, Any], dump: Path) -> dict[str, Any]:
    """A report's estimates recomputed from the compiler's dump its compile kept
    (`compile_report(keep_dump=...)`), with today's cost model: no compile. The collectives'
    summary and everything else the compile measured stay as reported."""
    tpu = parse_slice(report["topology"], report["num_slices"])
    devices = compile_only_devices(tpu)
    codegen = sorted(dump.glob("*after_codegen.txt"))
    if not (dump / PROGRAM).exists():
        raise FileNotFoundError(f"{dump} holds no compiled program ({PROGRAM})")
    rings = hlo_cost.rings(codegen[-1].read_text()) if codegen else {}
    fresh = _estimates(
        report,
        (dump / PROGRAM).read_text(),
        tpu,
        len(devices),
        devices,
        report["mesh"],
        rings,
        report.get("est_routed_rows_per_device"),
    )
    fresh.pop("collectives")
    repriced = {**report, **fresh}
    return repriced | _low_precision_mfu(
        repriced, report.get("quantize_mode", ""), tpu.chip, len(devices)
    )


def _low_precision_mfu(report: dict[str, Any], mode: str, chip: Chip, n: int) -> dict[str, Any]:
    """The estimated MFU against the chip's peak in the run's low-precision mode (`[quantize]`),
    beside the bf16-peak one the anchors quote; none without a mode or a published peak."""
    peak = {"int8": chip.peak_int8_ops, "fp8": chip.peak_fp8_flops}.get(mode, 0.0)
    if not peak or not report.get("est_step_time_s"):
        return {}
    return {
        "low_precision_peak": mode,
        "est_mfu_low_precision_pct": 100
        * report["analytic_flops_per_step"]
        / (n * peak * report["est_step_time_s"]),
    }


def _gb(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def _memory_lines(r: dict[str, Any]) -> list[str]:
    m = r["memory"]
    lines = [
        f"memory per chip: peak {_gb(r['per_chip_bytes'])} of the {_gb(r['usable_hbm_bytes'])}"
        f" XLA:TPU can use ({_gb(r['hbm_bytes'])} HBM) -> "
        f"{'fits' if r['fits'] else 'DOES NOT FIT'}, headroom {_gb(r['headroom_bytes'])}",
        "  (peak: live buffers at the program's fullest, arguments included, the figure "
        "XLA:TPU holds against its usable HBM; "
        + ", ".join(
            f"{k.removesuffix('_size_in_bytes')} {_gb(v)}"
            for k, v in m.items()
            if k != "peak_memory_in_bytes"
        )
        + f"; arguments + temporaries {_gb(r['args_plus_temps_bytes'])}, an overcount: "
        "their buffers partly live at different times)",
    ]
    if "compiler_error" in r:
        lines.append(f"compiler: {r['compiler_error']}")
    if r.get("top_buffers"):
        lines.append(
            "largest buffers: "
            + "; ".join(f"{_gb(b['bytes'])} {b['shapes'][:60]}" for b in r["top_buffers"][:5])
        )
    return lines


def _moe_estimate_lines(r: dict[str, Any]) -> list[str]:
    """What the estimate assumed of a MoE step, and its bound with every pick on one rank."""
    if not r.get("est_routed_rows_per_device"):
        return []
    fallbacks = [
        c
        for c in r["est_conditionals"]
        if c["expected"] and any(o["seconds"] > c["seconds"] for o in c["others"])
    ]
    other_s = sum(
        c["executions"] * (max(o["seconds"] for o in c["others"]) - c["seconds"]) for c in fallbacks
    )
    line = (
        f"  MoE: at balanced routing ({r['est_routed_rows_per_device']} rows per device "
        "through each expert kernel, priced at the row tiles they cover, not their "
        "buffers)"
    )
    skewed = r["est_all_to_one_rank_step_time_s"]
    if skewed is None:
        return [line + "; without expert parallelism routing moves no work between devices"]
    return [
        line + f" and the branches that routing takes ({len(fallbacks)} conditionals; "
        "their other branches, the overflow exchange when routing overflows the experts' "
        f"capacity, would add {other_s * 1e3:+.1f} ms); every pick routed to one "
        f"rank: step {skewed * 1e3:.1f} ms"
    ]


def format_report(r: dict[str, Any]) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"{r['model']} on {r['topology']} x {r['num_slices']} ({r['chips']} chips, "
        f"{r['tpu']}); mesh {mesh} ({r['mode']}, {r['fsdp_implementation']}), "
        f"params {r['param_dtype']}, remat {r['activation_checkpoint']}, attention "
        f"{r['attention']}",
        *_memory_lines(r),
    ]
    grouped = (
        f", grouped matmuls {r['grouped_matmul_flops_per_step']:.4g} at balanced "
        f"routing (buffer bound {r['grouped_matmul_flops_bound_per_step']:.4g})"
        if r["grouped_matmul_flops_bound_per_step"]
        else ""
    )
    lines.append(
        f"FLOPs per step: analytic {r['analytic_flops_per_step']:.4g}, compiled "
        f"{r['flops_per_step']:.4g} "
        f"(x{r['flops_per_step'] / r['analytic_flops_per_step']:.2f}: remat recompute "
        f"included; loop bodies counted per iteration; attention kernels "
        f"{r.get('attention_kernel_flops_per_step', 0):.4g}{grouped})"
    )
    lines.append(f"lowering {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s")
    if r["collectives"]:
        lines.append("collectives per step (bytes: result size per chip x executions):")
        lines += [
            f"  {c['op']:<18} {c['dtype']:<5} {c['network']}  "
            f"{'in layer loop' if c['in_layer_loop'] else 'once        '}  "
            f"over {c.get('axes', '-'):<10} "
            f"{c['count']:>3} ops  {c['executions']:>5} runs  {_gb(c['bytes_per_step'])}"
            for c in r["collectives"]
        ]
    if r.get("in_loop_all_gather_overlap_pct") is not None:
        flags = ", ".join(f"{k}={v}" for k, v in r["scheduler_flags"].items())
        lines.append(
            f"in-loop all-gathers: {r['in_loop_all_gathers']} ops, "
            f"{r['in_loop_all_gather_s'] * 1e3:.1f} ms on ICI per step, "
            f"{r['in_loop_all_gather_overlap_pct']:.0f}% covered by the compute the schedule "
            f"places under them (worst {r['in_loop_all_gather_min_overlap_pct']:.0f}%); "
            f"libtpu flags: {flags}"
        )
        # a flag a report does not list (one saved before it was a default) counts as set
        off = [
            f
            for f in DEFAULT_LIBTPU_FLAGS
            if r["scheduler_flags"].get(_flag_name(f), "true") != "true"
        ]
        if r["in_loop_all_gather_overlap_pct"] < 90 and off:
            lines.append(
                f"  hint: LIBTPU_INIT_ARGS='{' '.join(off)}' (titan-jax "
                "sets them by default unless LIBTPU_INIT_ARGS names them) makes them "
                "asynchronous"
            )
    if r["est_step_time_s"] is not None:
        low, high = calibration.step_band(r["est_step_time_s"], r["roofline_step_time_s"])
        mfu_low, mfu_high = calibration.mfu_band(r["est_mfu_pct"], r["roofline_mfu_pct"])
        lines.append(
            f"estimate (each compiled op at max(FLOPs at the rate a matmul of its size "
            f"sustains, int8/fp8 at theirs, bytes at the HBM bandwidth its size sustains), "
            f"host transfers over the host link, + exposed collectives; MFU against bf16's "
            f"peak): step {r['est_step_time_s'] * 1e3:.1f} ms ({low * 1e3:.0f}-"
            f"{high * 1e3:.0f} ms by the calibration's worst residuals) (compute "
            f"{r['est_compute_s'] * 1e3:.1f}, of which waiting on HBM copies and host transfers "
            f"{r['est_dma_wait_s'] * 1e3:.1f}; exposed collectives "
            f"{r['est_exposed_collective_s'] * 1e3:.1f}), MFU {r['est_mfu_pct']:.1f}% "
            f"({mfu_low:.1f}-{mfu_high:.1f}%)"
            + (
                f" ({r['est_mfu_low_precision_pct']:.1f}% of the {r['low_precision_peak']} peak)"
                if r.get("est_mfu_low_precision_pct") is not None
                else ""
            )
        )
        if r.get("cost_analysis_bytes_per_chip") is not None and r.get(
            "est_flops_loop_bodies_once"
        ):
            lines.append(
                f"  beside XLA's cost_analysis() (each loop body once, no custom-call kernels): "
                f"FLOPs {r['cost_analysis_flops_per_chip']:.4g} (ours "
                f"{r['est_flops_loop_bodies_once']:.4g}), bytes "
                f"{r['cost_analysis_bytes_per_chip']:.4g} (ours HBM "
                f"{r['est_hbm_bytes_loop_bodies_once']:.4g})"
            )
        if r.get("est_seconds_by_class"):
            lines.append(
                "  by op class: "
                + ", ".join(
                    f"{name} {s * 1e3:.1f} ms"
                    for name, s in sorted(r["est_seconds_by_class"].items(), key=lambda kv: -kv[1])
                    if s >= 5e-4
                )
            )
        lines += _moe_estimate_lines(r)
        lines.append(
            f"roofline bound (compute at peak, collectives fully overlapped): step "
            f"{r['roofline_step_time_s'] * 1e3:.1f} ms (compute {r['compute_s'] * 1e3:.1f}, "
            f"ICI {r['ici_s'] * 1e3:.1f}, DCN {r['dcn_s'] * 1e3:.1f}), MFU <= "
            f"{r['roofline_mfu_pct']:.1f}%"
        )
    return "\n".join(lines)
