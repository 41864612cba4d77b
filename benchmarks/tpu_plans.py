"""The pod recipes compiled ahead of time for their TPU slices (`titan-jax compile`), side by side
with MaxText's figures for the same recipe, as the table in docs/TPU.md.

Runs on any host with libtpu (the `tpu` extra); nothing executes on a TPU. Each row is one
`titan-jax compile`; `--only NAME` compiles the row named NAME (or else the rows whose names
start with it), `--write docs/TPU.md` (`make plans`) replaces the table between the markers
there. Compiles take minutes each on a 2-core host.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any

from titan_jax.atomic_dir import write_text_atomic
from titan_jax.config import load_config
from titan_jax.jax_platform import compile_only_libtpu
from titan_jax.planner.aot_compile import compile_report, reprice
from titan_jax.planner.calibration import with_band

BEGIN, END = "<!-- tpu_plans:begin -->", "<!-- tpu_plans:end -->"
MAXTEXT = "MaxText 0.2.5"  # the side-by-side anchor (benchmarks/maxtext-constraints.txt)
GB = 1e9  # MaxText prints decimal GB; so does this table


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    config: str
    topology: str
    overrides: tuple[str, ...] = ()
    num_slices: int = 1
    # MAXTEXT at the same recipe (AOT on this CPU, same jax and libtpu; NOTES.md): arguments,
    # temporaries (GB) and compile time (s); None where not measured.
    maxtext: tuple[float, float, float | None] | None = None
    # A published hardware measurement of the same recipe, for the reference column.
    measured: str | None = None


# The setting for 8B: 2 x 4096 tokens per chip, fp32 master weights, bf16 compute,
# full remat, AdamW; configs/qwen3_8b.toml is that recipe.
PLANS = (
    Plan("8B v5p-8", "configs/qwen3_8b.toml", "v5p-8", maxtext=(24.58, 20.11, 72)),
    Plan("8B v6e-8", "configs/qwen3_8b.toml", "v6e-8", maxtext=(12.29, 16.22, 187)),
    # The TorchTitan TPU fork's measured recipe (35-36% MFU on a real v6e-8; docs/TPU.md).
    Plan(
        "8B v6e-8 6 x 2048 (fork)",
        "configs/qwen3_8b.toml",
        "v6e-8",
        ("--training.local_batch_size", "6", "--training.seq_len", "2048"),
        measured="TorchTitan TPU fork, real v6e-8: 35-36% MFU",
    ),
    Plan(
        "8B v5p-8 remat none",
        "configs/qwen3_8b.toml",
        "v5p-8",
        ("--activation_checkpoint.mode", "none"),
    ),
    Plan(
        "8B v5p-8 remat selective",
        "configs/qwen3_8b.toml",
        "v5p-8",
        ("--activation_checkpoint.mode", "selective"),
    ),
    Plan(
        "8B v5p-8 remat offload",
        "configs/qwen3_8b.toml",
        "v5p-8",
        ("--activation_checkpoint.mode", "offload"),
    ),
    Plan("8B v5p-8 xla attention", "configs/qwen3_8b.toml", "v5p-8", ("--model.attention", "xla")),
    Plan("32B v5p-32", "configs/qwen3_32b.toml", "v5p-32"),
    # fsdp8 x ep16 as shipped; beside it ep8 and ep32, each with MaxText's program at the same
    # layout (its best, ep8, is the anchor in docs/MOE.md).
    Plan(
        "235B-A22B v5p-256", "configs/qwen3_235b_a22b.toml", "v5p-256", maxtext=(22.05, 53.93, 107)
    ),
    Plan(
        "235B-A22B v5p-256 ep8",
        "configs/qwen3_235b_a22b.toml",
        "v5p-256",
        ("--parallelism.expert_parallel_degree", "8"),
        maxtext=(22.05, 42.99, 452),
    ),
    Plan(
        "235B-A22B v5p-256 ep32",
        "configs/qwen3_235b_a22b.toml",
        "v5p-256",
        ("--parallelism.expert_parallel_degree", "32"),
        maxtext=(22.05, 53.58, 171),
    ),
    # The MoE recipes as shipped (`auto` picks shard_map for MoE on TPU).
    Plan("30B-A3B v5p-16", "configs/qwen3_30b_a3b.toml", "v5p-16", maxtext=(45.80, 29.20, 386)),
    Plan("30B-A3B v6e-32", "configs/qwen3_30b_a3b.toml", "v6e-32"),
    # Gradients reduced in bf16 (TorchTitan's mixed_precision_reduce; MaxText's default):
    # half the reduce-scatters' bytes, at fsdp4 x ep32 beside its row `235B-A22B v5p-256 ep32`.
    Plan(
        "235B-A22B v5p-256 bf16 reduce",
        "configs/qwen3_235b_a22b.toml",
        "v5p-256",
        (
            "--training.mixed_precision_reduce",
            "bfloat16",
            "--parallelism.expert_parallel_degree",
            "32",
        ),
    ),
    # FSDP x TP 4, the 235B recipe shipped before expert parallelism.
    Plan(
        "235B-A22B v5p-256 tp4",
        "configs/qwen3_235b_a22b.toml",
        "v5p-256",
        (
            "--parallelism.tensor_parallel_degree",
            "4",
            "--parallelism.expert_parallel_degree",
            "1",
            "--parallelism.expert_parallel_chunks",
            "1",
        ),
    ),
    Plan(
        "8B 2 x v5p-8 (HSDP over DCN)",
        "configs/qwen3_8b.toml",
        "v5p-8",
        ("--parallelism.data_parallel_replicate_degree", "2"),
        num_slices=2,
    ),
)

# Low precision (issue 31): the 8B recipe with int8 matmuls on v6e and v5p (twice bf16's
# rate) and, beside its bf16 twin, fp8 on Ironwood (tpu7x-8: 4 chips, 8 TensorCores); their
# weights gathered as one-byte codes (issue 44, `quantize.gather`).
LOW_PRECISION_PLANS = (
    Plan("8B v6e-8 int8", "configs/qwen3_8b.toml", "v6e-8", ("--quantize.mode", "int8")),
    Plan("8B v5p-8 int8", "configs/qwen3_8b.toml", "v5p-8", ("--quantize.mode", "int8")),
    Plan("8B tpu7x-8", "configs/qwen3_8b.toml", "tpu7x-8"),
    Plan("8B tpu7x-8 fp8", "configs/qwen3_8b.toml", "tpu7x-8", ("--quantize.mode", "fp8")),
    # 256 chips (512 TensorCores) at MaxText's published Ironwood recipe's batch: 16 x 4096
    # tokens per TensorCore, bf16 (its authors measured 30.87 s a step on the hardware), here
    # as 4 microbatches of 4 (16 at once would need 197 GB a TensorCore).
    Plan(
        "235B-A22B tpu7x-512 16 x 4096",
        "configs/qwen3_235b_a22b.toml",
        "tpu7x-512",
        (
            "--training.local_batch_size",
            "4",
            "--training.global_batch_size",
            "8192",
            "--parallelism.expert_parallel_degree",
            "8",
        ),
        measured="MaxText, real tpu7x-512: 30.87 s, 27.3% MFU (its count)",
    ),
    # MaxText's layout for that recipe: FSDP over all 512, no expert parallelism, the 16
    # sequences at once with each layer's input offloaded to host memory; the experts' weights
    # gathered at their use (28.37 s; 29.86 s gathered before the router, docs/MOE.md).
    Plan(
        "235B-A22B tpu7x-512 16 x 4096 fsdp512",
        "configs/qwen3_235b_a22b.toml",
        "tpu7x-512",
        (
            "--training.local_batch_size",
            "16",
            "--parallelism.expert_parallel_degree",
            "1",
            "--parallelism.expert_parallel_chunks",
            "1",
            "--activation_checkpoint.offload_layer_input",
            "true",
            "--parallelism.fsdp_expert_gather_before_router",
            "false",
        ),
        measured="MaxText, real tpu7x-512: 30.87 s, 27.3% MFU (its count)",
    ),
    # The same slice at the shipped recipe's 1 x 4096 tokens per TensorCore, in bf16 and in fp8
    # (at ep8): what fp8 (matmuls and the FSDP gathers' codes) buys on Ironwood.
    Plan(
        "235B-A22B tpu7x-512 bf16 ep8",
        "configs/qwen3_235b_a22b.toml",
        "tpu7x-512",
        ("--parallelism.expert_parallel_degree", "8"),
    ),
    Plan(
        "235B-A22B tpu7x-512 fp8",
        "configs/qwen3_235b_a22b.toml",
        "tpu7x-512",
        ("--quantize.mode", "fp8", "--parallelism.expert_parallel_degree", "8"),
    ),
    # The v5p-256 recipe at fsdp4 x ep32 in int8, beside its bf16 row `235B-A22B v5p-256 ep32`.
    Plan(
        "235B-A22B v5p-256 int8",
        "configs/qwen3_235b_a22b.toml",
        "v5p-256",
        ("--quantize.mode", "int8", "--parallelism.expert_parallel_degree", "32"),
    ),
)

# Long context (issue 20): 32K sequences with the global batch fixed so that context
# parallelism is needed (fewer sequences than chips x their memory allows).
LONG_CONTEXT_PLANS = (
    Plan("8B 32K v6e-8 cp2 (4 seqs)", "configs/qwen3_8b_32k.toml", "v6e-8"),
    Plan("8B 32K v5p-8 cp2 (4 seqs)", "configs/qwen3_8b_32k.toml", "v5p-8"),
    # The ring variant of the same two (parallelism.context_parallel_method; XLA blocks).
    Plan(
        "8B 32K v6e-8 cp2 ring (4 seqs)",
        "configs/qwen3_8b_32k.toml",
        "v6e-8",
        ("--parallelism.context_parallel_method", "ring"),
    ),
    Plan(
        "8B 32K v5p-8 cp2 ring (4 seqs)",
        "configs/qwen3_8b_32k.toml",
        "v5p-8",
        ("--parallelism.context_parallel_method", "ring"),
    ),
    Plan("30B-A3B 32K v5p-16 cp4 (8 seqs)", "configs/qwen3_30b_a3b_32k.toml", "v5p-16"),
    # cp4: at cp2 the 94 layers' saved inputs do not fit (docs/TPU.md, long context).
    Plan(
        "235B-A22B 32K v5p-256 cp4 (64 seqs)",
        "configs/qwen3_235b_a22b.toml",
        "v5p-256",
        (
            "--training.seq_len",
            "32768",
            "--training.global_batch_size",
            "64",
            "--parallelism.context_parallel_degree",
            "4",
            "--parallelism.expert_parallel_degree",
            "8",
        ),
    ),
)
# Post-training (issue 43): full SFT and LoRA / QLoRA of the shipped recipes, each LoRA row
# beside full fine-tuning of the same model on the same slice (its memory is the comparison).
POSTTRAINING_PLANS = (
    Plan("8B SFT v5p-8", "configs/qwen3_8b_sft.toml", "v5p-8"),
    Plan("8B SFT v6e-8", "configs/qwen3_8b_sft.toml", "v6e-8"),
    Plan("8B SFT v5e-8", "configs/qwen3_8b_sft.toml", "v5e-8"),
    Plan("8B LoRA v5e-8", "configs/qwen3_8b_lora.toml", "v5e-8"),
    Plan("8B LoRA v5e-4", "configs/qwen3_8b_lora.toml", "v5e-4"),
    Plan("8B QLoRA nf4 v5e-4", "configs/qwen3_8b_qlora.toml", "v5e-4"),
    Plan(
        "8B QLoRA int8 v5e-1", "configs/qwen3_8b_qlora.toml", "v5e-1", ("--lora.base_dtype", "int8")
    ),
    Plan(
        "30B-A3B SFT v5p-8",
        "configs/qwen3_30b_a3b.toml",
        "v5p-8",  # the LoRA row's shape
        ("--training.local_batch_size", "1", "--activation_checkpoint.mode", "selective"),
    ),
    Plan("30B-A3B LoRA v5p-8", "configs/qwen3_30b_a3b_lora.toml", "v5p-8"),
)
PLANS = PLANS + LOW_PRECISION_PLANS + LONG_CONTEXT_PLANS + POSTTRAINING_PLANS


def run(plan: Plan, keep_dump: Path | None = None) -> dict[str, Any]:
    config = load_config(plan.config, list(plan.overrides))
    return compile_report(config, plan.topology, plan.num_slices, keep_dump=keep_dump)


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / GB:.2f}"


def row(plan: Plan, r: dict[str, Any]) -> str:
    m = r["memory"]
    mt = plan.maxtext
    maxtext = (
        f"{mt[0]:.2f} + {mt[1]:.2f} = {mt[0] + mt[1]:.2f}; "
        f"{'-' if mt[2] is None else f'{mt[2]:.0f} s'}"
        if mt
        else plan.measured or "-"
    )
    mesh = " ".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1)
    kernel = r.get("attention_kernel_flops_per_step") or 0  # splash, counted from its shapes
    attention = r["attention"] + (f" ({kernel / 1e15:.2f} PFLOP)" if kernel else "")
    est = (
        f"{with_band(r['est_step_time_s'], r['est_mfu_pct'], r['roofline_mfu_pct'])} "
        f"(<= {r['roofline_mfu_pct']:.0f}%)"
        if r["est_step_time_s"] is not None
        else "-"
    )
    if r.get("est_all_to_one_rank_step_time_s"):
        est += f"; one rank {r['est_all_to_one_rank_step_time_s']:.2f} s"
    overlap = r.get("in_loop_all_gather_overlap_pct")
    overlap = "-" if overlap is None else f"{overlap:.0f}%"
    return (
        f"| {plan.name} | {mesh} | {r['activation_checkpoint']} | {attention} | "
        f"{_gb(m.get('argument_size_in_bytes'))} + {_gb(m.get('temp_size_in_bytes'))} | "
        f"{_gb(r['per_chip_bytes'])} of {_gb(r['usable_hbm_bytes'])} | "
        f"{'yes' if r['fits'] else '**no**'} | {r['compile_s']:.0f} s | {est} | "
        f"{xla_ratios(r)} | {overlap} | {maxtext} |"
    )


def xla_ratios(r: dict[str, Any]) -> str:
    """XLA's own `cost_analysis()` FLOPs and bytes over ours counted the same way (each loop
    body once, no custom-call kernels): the consistency column."""
    ours_flops, ours_bytes = (
        r.get("est_flops_loop_bodies_once"),
        r.get("est_hbm_bytes_loop_bodies_once"),
    )
    if not ours_flops or not ours_bytes or r.get("cost_analysis_bytes_per_chip") is None:
        return "-"
    return (
        f"{r['cost_analysis_flops_per_chip'] / ours_flops:.2f} / "
        f"{r['cost_analysis_bytes_per_chip'] / ours_bytes:.2f}"
    )


def stack() -> str:
    """The compiler the figures come from, as installed."""
    return ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("jax", "libtpu"))


def markdown(rows: list[str]) -> str:
    stamp = datetime.date.today().isoformat()
    return "\n".join(
        [
            f"Measured {stamp} with `make plans` (`python benchmarks/tpu_plans.py --write "
            f"docs/TPU.md`): {stack()}, compiled on a 2-core CPU host (compile "
            "times are this host's). Memory per chip from the compiled program "
            "(`memory_analysis()`, GB = 1e9 bytes): arguments (sharded params + AdamW state + "
            "batch) and temporaries; `fits` compares the program's peak of live buffers with the "
            "HBM XLA:TPU lets a program use, as the compiler does. The estimate prices each "
            "compiled op at max(FLOPs at the rate a matmul of its size sustains on the chip "
            "(int8/fp8 matmuls at the chip's rate for them), bytes at the HBM bandwidth its size "
            "sustains), host transfers over the host link, plus exposed collectives; in brackets "
            "after the step and the MFU, the band the calibration's worst residuals give "
            '(docs/TPU.md, "Calibration"); MFU is against the bf16 peak; after them the '
            "roofline bound. A MoE step is estimated at balanced routing "
            "(the branch of each conditional that routing takes, grouped matmuls at the rows it "
            "fills); `one rank`: every pick routed to one rank (the dropless fallback, whole "
            "buffers). XLA / ours: XLA's `cost_analysis()` FLOPs and bytes over ours counted as "
            "it counts (each loop body once, no custom-call kernels). tpu7x figures are per "
            "TensorCore (JAX's device; two a chip). Overlap: the share of the in-loop "
            "all-gathers' ICI time the schedule covers with compute. Estimates, not measurements. "
            f"Rows marked `{STALE}` were not recompiled since the sustained rates: their "
            "estimate is the older peak-rate one, without a band.",
            "",
            "| recipe | mesh | remat | attention (kernel FLOPs per step) | args + temps (GB) | "
            "peak of usable (GB) | fits | compile | est. step / MFU (band; bound) | XLA / ours: "
            f"FLOPs / bytes | gather overlap | {MAXTEXT} args + temps (GB); compile, or a "
            "hardware measurement |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


STALE = "(peak-rate model)"


def _upgraded(line: str) -> str:
    """A row of the table before the sustained rates (no XLA column): its estimate marked as
    the older model's, and no XLA figures."""
    cells = line.split("|")
    cells[9] = f" {cells[9].strip()} {STALE} " if cells[9].strip() != "-" else cells[9]
    return "|".join([*cells[:10], " - ", *cells[10:]])


def merged(old_table: str, rows: list[str]) -> list[str]:
    """The rows of `old_table` (the block between the markers), each replaced by the new row
    of the same recipe, new recipes appended: `--only` updates its rows and keeps the rest
    (rows of the layout before the XLA column are kept with their estimate marked as the
    older model's; rows of plans no longer in PLANS are dropped)."""
    name = lambda line: line.split("|")[1].strip()  # noqa: E731
    columns = lambda line: line.count("|")  # noqa: E731
    new = {name(r): r for r in rows}
    planned = {p.name for p in PLANS}
    width = columns(rows[0])
    old = [
        line if columns(line) == width else _upgraded(line)
        for line in old_table.splitlines()
        if line.startswith("| ")
        and not line.startswith("| recipe ")
        and columns(line) in (width, width - 1)
        and name(line) in planned
    ]
    kept = [new.pop(name(line), line) for line in old]
    return kept + [r for r in rows if name(r) in new]


def write_table(path: Path, rows: list[str]) -> None:
    text = path.read_text()
    old = re.search(re.escape(BEGIN) + "(.*?)" + re.escape(END), text, flags=re.S)
    block = f"{BEGIN}\n{markdown(merged(old[1] if old else '', rows))}\n{END}"
    write_text_atomic(
        path, re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    )


def selects(only: str, name: str) -> bool:
    """Whether `--only only` selects the plan `name`: its exact name, else a prefix of names
    (`235B-A22B tpu7x-512 16 x 4096` is a row and the prefix of its fsdp512 sibling)."""
    exact = any(p.name == only for p in PLANS)
    return name == only if exact else name.startswith(only)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="compile only the plan named NAME, or where none is, the plans whose name starts "
        "with NAME",
    )
    parser.add_argument("--json", metavar="DIR", help="also write each report as JSON here")
    parser.add_argument("--write", metavar="FILE", help="replace the table in FILE")
    parser.add_argument(
        "--reports",
        metavar="DIR",
        help="the rows from reports an earlier --json wrote, not compiles",
    )
    parser.add_argument(
        "--dumps",
        metavar="DIR",
        type=Path,
        help="keep each compile's program here; with --reports, re-price "
        "the reports from the programs kept here (no compile)",
    )
    opts = parser.parse_args()
    compile_only_libtpu()  # before libtpu loads: CPU-hosted, with titan-jax's default flags
    plans = [p for p in PLANS if not opts.only or any(selects(o, p.name) for o in opts.only)]
    rows = []
    for plan in plans:
        name = re.sub(r"[^\w.-]+", "_", plan.name)
        if opts.reports:
            path = Path(opts.reports) / f"{name}.json"
            if not path.exists():
                continue
            report = json.loads(path.read_text())
            if opts.dumps and (opts.dumps / name).exists():
                report = reprice(report, opts.dumps / name)
        else:
            report = run(plan, opts.dumps / name if opts.dumps else None)
        rows.append(row(plan, report))
        print(rows[-1], flush=True)
        if opts.json:
            Path(opts.json).mkdir(parents=True, exist_ok=True)
            write_text_atomic(Path(opts.json) / f"{name}.json", json.dumps(report, indent=2))
    print(markdown(rows))
    if opts.write:
        write_table(Path(opts.write), rows)


if __name__ == "__main__":
    main()
