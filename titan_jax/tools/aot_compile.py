"""`titan-jax compile`: the exact train step compiled ahead of time for a named TPU slice, from a
CPU host, to plan a pod job before paying for one.

Reports per-chip memory from the compiled program (does the recipe fit in HBM?), FLOPs per step
(analytic, and the compiler's matmul count weighted by loop trip counts), the collectives of the
compiled HLO, and a roofline estimate of step time and MFU. The estimate assumes compute at the
chip's bf16 peak, collectives at the published ICI/DCN bandwidth with ring algorithms, and the
two fully overlapped: a lower bound on step time, not a measurement.
"""

from __future__ import annotations

import re
import time
from typing import Any

import jax
import numpy as np

from titan_jax.config import ConfigError, JobConfig
from titan_jax.parallel.topology import Chip, TpuSlice, compile_only_devices, parse_slice
from titan_jax.tools import hlo_stats, inspect
from titan_jax.train.trainer import Trainer, build_trainer

_OOM_TEMPORARIES = re.compile(r"HLO temporaries \(([0-9.]+)([GMK]?)\)")
_UNITS = {"G": 2**30, "M": 2**20, "K": 2**10, "": 1}


def _moved_bytes(op: str, result_bytes: int, group: int) -> float:
    """Bytes one device sends for a collective with a ring algorithm over `group` devices."""
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    return {"all-gather": result_bytes * share,
            "reduce-scatter": result_bytes * (group - 1),  # the result is one shard
            "all-reduce": 2 * result_bytes * share,
            "all-to-all": result_bytes * share,
            "ragged-all-to-all": result_bytes * share,
            "collective-permute": float(result_bytes)}[op]


def _network(groups: list[list[int]], slice_of: list[int]) -> str:
    """`dcn` when a device group spans slices, else `ici`."""
    spans = any(len({slice_of[i] for i in g if i < len(slice_of)}) > 1 for g in groups)
    return "dcn" if spans else "ici"


def collectives(hlo_text: str, mesh_devices: list[Any]) -> list[dict[str, Any]]:
    """The compiled step's collectives with their network, loop placement and ring time."""
    slice_of = [getattr(d, "slice_index", 0) for d in mesh_devices]
    ops = hlo_stats.collective_ops(hlo_stats.parse(hlo_text))
    for c in ops:
        if c.get("network") == "dcn":  # a megascale transfer: one peer per slice
            group = len(set(slice_of))
        else:
            group = max((len(g) for g in c["groups"]), default=len(mesh_devices))
            c["network"] = _network(c["groups"], slice_of)
        c["in_layer_loop"] = c["executions"] > 1
        c["moved_bytes_per_step"] = _moved_bytes(c["op"], c["bytes"], group) * c["executions"]
    return ops


def roofline(chip: Chip, flops_per_chip: float, ops: list[dict[str, Any]]
             ) -> dict[str, float]:
    compute_s = flops_per_chip / chip.peak_bf16_flops
    ici_s = sum(c["moved_bytes_per_step"] for c in ops if c["network"] == "ici")
    dcn_s = sum(c["moved_bytes_per_step"] for c in ops if c["network"] == "dcn")
    ici_s, dcn_s = ici_s / chip.ici_bytes_per_s, dcn_s / chip.dcn_bytes_per_s
    return {"compute_s": compute_s, "ici_s": ici_s, "dcn_s": dcn_s,
            "est_step_time_s": max(compute_s, ici_s + dcn_s)}


def _memory(compiled: Any, chip: Chip) -> dict[str, Any]:
    stats = inspect.memory(compiled)
    per_chip = (stats.get("argument_size_in_bytes", 0) + stats.get("output_size_in_bytes", 0)
                - stats.get("alias_size_in_bytes", 0) + stats.get("temp_size_in_bytes", 0))
    return {"memory": stats, "per_chip_bytes": per_chip, "hbm_bytes": chip.hbm_bytes,
            "fits": per_chip <= chip.hbm_bytes, "headroom_bytes": chip.hbm_bytes - per_chip}


def _out_of_memory(error: Exception, chip: Chip, argument_bytes: int) -> dict[str, Any] | None:
    """The compiler's own verdict when the program cannot fit: XLA:TPU refuses to compile it
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
    temporaries (140.31G) exceeds available HBM (15.75G)"). Arguments (the sharded train state
    and batch) are known without compiling; temporaries come from the message when it has them."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text or "memory" not in text.lower():
        return None
    temps = _OOM_TEMPORARIES.search(text)
    memory = {"argument_size_in_bytes": argument_bytes}
    if temps:
        memory["temp_size_in_bytes"] = int(float(temps[1]) * _UNITS[temps[2]])
    per_chip = sum(memory.values())
    return {"memory": memory, "per_chip_bytes": per_chip, "hbm_bytes": chip.hbm_bytes,
            "fits": False, "headroom_bytes": chip.hbm_bytes - per_chip,
            "compiler_error": text.strip().splitlines()[0][:500]}


def _build(config: JobConfig, tpu: TpuSlice, devices: list[Any], model_args: Any) -> Trainer:
    try:
        return build_trainer(config, devices, model_args=model_args)
    except ConfigError as e:
        raise ConfigError(f"--topology {tpu.name} x {tpu.num_slices} slice(s) = "
                          f"{len(devices)} devices: {e}") from None


def compile_report(config: JobConfig, topology: str, num_slices: int = 1,
                   model_args: Any = None) -> dict[str, Any]:
    """Compile the train step for `topology` with abstract inputs and report what it costs."""
    tpu = parse_slice(topology, num_slices)
    devices = compile_only_devices(tpu)
    trainer = _build(config, tpu, devices, model_args)
    start = time.perf_counter()
    lowered = trainer.lower_step(trainer.abstract_state(), inspect.abstract_batch(trainer))
    lower_s = time.perf_counter() - start
    flops, unknown_loops = hlo_stats.dot_flops(hlo_stats.parse(lowered.as_text(dialect="hlo")))
    analytic = trainer.flops_per_token() * trainer.tokens_per_step
    n = len(devices)
    report: dict[str, Any] = {
        "topology": tpu.name, "num_slices": num_slices, "chips": n,
        "tpu": tpu.libtpu_name, "chip_source": tpu.chip.source,
        "model": f"{config.model.name} {config.model.flavor}",
        "mesh": dict(trainer.mesh.shape), "mode": trainer.degrees.mode,
        "fsdp_implementation": trainer.parallelism.implementation,
        "param_dtype": np.dtype(trainer.options.param_dtype).name,
        "activation_checkpoint": config.activation_checkpoint.mode,
        "attention": trainer.attention,
        "tokens_per_step": trainer.tokens_per_step,
        "analytic_flops_per_step": analytic,
        # What the program executes (remat recomputation included), counted from its matmuls.
        "flops_per_step": flops, "flops_loops_of_unknown_length": unknown_loops,
        "lower_s": lower_s,
    }
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        arguments = inspect.state_bytes(trainer)[0] + sum(
            inspect.leaf_bytes_per_device(x) for x in inspect.abstract_batch(trainer).values())
        verdict = _out_of_memory(e, tpu.chip, arguments)
        if verdict is None:
            raise
        return {**report, **verdict, "compile_s": time.perf_counter() - start,
                "collectives": [], "est_step_time_s": None, "est_mfu_pct": None}
    report["compile_s"] = time.perf_counter() - start
    report.update(_memory(compiled, tpu.chip))
    report["cost_analysis_flops_per_chip"] = float(compiled.cost_analysis().get("flops", 0.0))
    ops = collectives(compiled.as_text(), list(trainer.mesh.devices.flat))
    report["collectives"] = hlo_stats.summarize(ops, ("op", "dtype", "network", "in_layer_loop"))
    # The analytic count also has the norm weights' 6 FLOPs per parameter, which are not
    # matmuls: take the larger, so the estimate never claims more than 100%.
    estimate = roofline(tpu.chip, max(flops, analytic) / n, ops)
    report.update(estimate)
    report["est_mfu_pct"] = 100 * analytic / (n * tpu.chip.peak_bf16_flops
                                              * estimate["est_step_time_s"])
    return report


def _gb(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def format_report(r: dict[str, Any]) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [f"{r['model']} on {r['topology']} x {r['num_slices']} ({r['chips']} chips, "
             f"{r['tpu']}); mesh {mesh} ({r['mode']}, {r['fsdp_implementation']}), "
             f"params {r['param_dtype']}, remat {r['activation_checkpoint']}, attention "
             f"{r['attention']}"]
    m = r["memory"]
    lines.append(
        f"memory per chip: {_gb(r['per_chip_bytes'])} of {_gb(r['hbm_bytes'])} HBM -> "
        f"{'fits' if r['fits'] else 'DOES NOT FIT'} ("
        + ", ".join(f"{k.removesuffix('_size_in_bytes')} {_gb(v)}" for k, v in m.items()
                    if k != "peak_memory_in_bytes") + ")")
    if "compiler_error" in r:
        lines.append(f"compiler: {r['compiler_error']}")
    lines.append(f"FLOPs per step: analytic {r['analytic_flops_per_step']:.4g}, compiled "
                 f"matmuls {r['flops_per_step']:.4g} "
                 f"(x{r['flops_per_step'] / r['analytic_flops_per_step']:.2f}: remat recompute "
                 "included; loop bodies counted per iteration)")
    lines.append(f"lowering {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s")
    if r["collectives"]:
        lines.append("collectives per step (bytes: result size per chip x executions):")
        lines += [f"  {c['op']:<18} {c['dtype']:<5} {c['network']}  "
                  f"{'in layer loop' if c['in_layer_loop'] else 'once        '}  "
                  f"{c['count']:>3} ops  {c['executions']:>5} runs  {_gb(c['bytes_per_step'])}"
                  for c in r["collectives"]]
    if r["est_step_time_s"] is not None:
        lines.append(
            f"roofline estimate (compute at bf16 peak, ring collectives at published ICI/DCN "
            f"bandwidth, fully overlapped): step {r['est_step_time_s'] * 1e3:.1f} ms "
            f"(compute {r['compute_s'] * 1e3:.1f}, ICI {r['ici_s'] * 1e3:.1f}, DCN "
            f"{r['dcn_s'] * 1e3:.1f}), MFU <= {r['est_mfu_pct']:.1f}%")
    return "\n".join(lines)
