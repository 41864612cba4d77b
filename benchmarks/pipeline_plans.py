"""Pipeline stages against data parallelism for the recipes users ask about, priced without a
compile (`titan_jax/planner/pipeline_cost.py`): Qwen3-235B-A22B on 2 and 4 slices, PP across
the slices against HSDP across them, and Qwen3-32B on one slice with and without PP. Prints the
table; `--write docs/PARALLELISM.md` (`make plans`) replaces it between the markers there.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from titan_jax.atomic_dir import write_text_atomic
from titan_jax.planner.pipeline_cost import Layout, ModelShape, layout_cost
from titan_jax.planner.topology import parse_slice

BEGIN, END = "<!-- pipeline_plans:begin -->", "<!-- pipeline_plans:end -->"
SEQ_LEN = 4096


@dataclasses.dataclass(frozen=True)
class Row:
    flavor: str
    slice_name: str
    num_slices: int
    rows_per_rank: int  # rows of 4096 tokens a data-parallel rank holds without PP
    tokens_per_chip: int  # 235B: the rank's rows (a chip, ep x fsdp); 32B: a quarter (tp4)
    layout: Layout


def _rows() -> list[Row]:
    """Each layout at the same global batch as its no-PP row: the shipped recipe's (one row a
    data-parallel rank), and 4x it. Under PP a rank holds pp x the rows, cut into microbatches
    of whole rows: at most pp x rows of them (the smallest bubble at that batch)."""
    rows = []
    for slice_name, slices in (("v5p-256", 2), ("v5p-256", 4), ("v5p-128", 2)):
        for per_rank in (1, 4):
            m = slices * per_rank
            for layout in (
                Layout(),
                Layout(slices, 1, m),
                Layout(slices, 1, m, "1f1b"),
                Layout(slices, 2, m),
            ):
                rows.append(
                    Row("235B-A22B", slice_name, slices, per_rank, per_rank * SEQ_LEN, layout)
                )
    for per_rank in (1, 4):
        for layout in (Layout(), Layout(2, 1, 2 * per_rank), Layout(4, 1, 4 * per_rank)):
            rows.append(Row("32B", "v5p-32", 1, per_rank, per_rank * SEQ_LEN // 4, layout))
    return rows


def _name(layout: Layout, slices: int) -> str:
    if layout.pp == 1:
        return "no PP (HSDP across slices)" if slices > 1 else "no PP (FSDP)"
    kind = layout.schedule if layout.virtual == 1 else f"interleaved v{layout.virtual}"
    return f"pp{layout.pp} {kind} m{layout.microbatches}"


def table() -> str:
    lines = [
        "| model | slices | rows a rank (no PP) | layout | bubble | compute s | + bubble s | "
        "+ DCN s | + ICI sends s | weight gathers | state GB/chip | activations GB/chip | "
        "step <= s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shapes: dict[str, ModelShape] = {}
    for r in _rows():
        if r.flavor not in shapes:
            shapes[r.flavor] = ModelShape.of("qwen3", r.flavor, SEQ_LEN)
        tpu = parse_slice(r.slice_name, r.num_slices)
        c = layout_cost(shapes[r.flavor], tpu, r.tokens_per_chip, r.layout, r.rows_per_rank)
        lines.append(
            f"| {r.flavor} | {r.num_slices} x {r.slice_name} | {r.rows_per_rank} | "
            f"{_name(r.layout, r.num_slices)} | "
            f"{c.bubble_fraction:.0%} | {c.compute_s:.2f} | {c.bubble_s:.2f} | {c.dcn_s:.3f} | "
            f"{c.ici_sends_s:.4f} | {c.weight_gathers:.1f}x | {c.state_bytes / 1e9:.1f} | "
            f"{c.activation_bytes / 1e9:.2f} | {c.step_s:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", type=Path, help="replace the table in this markdown file")
    out = table()
    target = parser.parse_args().write
    if target is None:
        print(out)
        return
    text = target.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    write_text_atomic(target, f"{head}{BEGIN}\n{out}\n{END}{tail}")


if __name__ == "__main__":
    main()
