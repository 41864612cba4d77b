"""Figures read from HLO text: matmul FLOPs and collectives, counted per executed step.

XLA's `cost_analysis()` counts a while loop's body once, so for a step whose layers are scanned
it reports several times fewer FLOPs than run. Here every computation is weighted by how often
it runs: a while body by its trip count (from the loop condition's `i < N` or XLA's
`known_trip_count`), nested loops multiplied. Dots and grouped matmuls (`ragged-dot`) are counted
(the matmul FLOPs that MFU is about); Pallas kernels in custom calls are counted from their
shapes where this module knows the kernel (`kernel_flops`: splash attention, XLA:TPU's
grouped-matmul kernel).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from titan_jax.planner_hints import EXPECTED_BRANCH, RARE_BRANCH

COLLECTIVE_OPS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([0-9,]*)\]")  # f8e4m3fn too
# A grouped-matmul kernel's (FLOPs, buffer rows) from (instruction, its computation), or None.
GroupedKernel = Callable[["Instruction", str], "tuple[float, int] | None"]
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_CALLED_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_PASS_THROUGH = ("custom-call", "copy", "convert", "bitcast", "reshape")
_MANUAL_BODY = "manual_computation_body"  # a shard_map body, as JAX names it
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")  # the printer marks every fifth operand
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_HLO_ITEMSIZE = {
    "pred": 1,
    "bf16": 2,
    "f16": 2,
    "f32": 4,
    "f64": 8,
    "s8": 1,
    "s16": 2,
    "s32": 4,
    "s64": 8,
    "u8": 1,
    "u16": 2,
    "u32": 4,
    "u64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # the result type, e.g. "f32[8,16]{1,0}" or a tuple
    op: str  # e.g. "dot", "all-gather-start", "while"
    rest: str  # operands and attributes

    @property
    def operands(self) -> list[str]:
        """Operand names (the text up to the closing parenthesis of the call)."""
        depth, names, start = 0, [], 0
        for end, ch in enumerate(self.rest):
            depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
            if depth <= 0 and ch in ",)":  # a top-level comma, or the call's closing paren
                if operand := _INDEX_COMMENT.sub("", self.rest[start:end]).strip():
                    names.append(operand.split()[-1].lstrip("%"))  # "f32[2]{0} %a" -> "a"
                start = end + 1
                if depth < 0:
                    break
        return names


@dataclasses.dataclass
class HloModule:
    computations: dict[str, list[Instruction]]
    entry: str

    def defining(self, computation: str) -> dict[str, Instruction]:
        return {i.name: i for i in self.computations[computation]}


def _joined_lines(text: str) -> list[str]:
    """Lines with continuations joined: compiled custom calls spread their kernel metadata
    over lines that start with a quote or with `}}`."""
    lines: list[str] = []
    for line in text.splitlines():
        if lines and (line.startswith('"') or line.startswith("}}")):
            lines[-1] += line
        else:
            lines.append(line)
    return lines


def parse(text: str) -> HloModule:
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in _joined_lines(text):
        if not line.startswith((" ", "\t", "}")) and line.rstrip().endswith("{"):
            if header := _HEADER.match(line):
                current = header[2]
                computations[current] = []
                entry = current if header[1] else entry
        elif current is not None and (m := _INSTRUCTION.match(line)):
            computations[current].append(Instruction(m[1], m[2], m[3], m[4]))
    return HloModule(computations, entry)


def arrays(hlo_type: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each array in an HLO type (a tuple lists several)."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(hlo_type)
    ]


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * _HLO_ITEMSIZE.get(dtype, 1)


def trip_count(module: HloModule, loop: Instruction) -> int | None:
    """Iterations of a while loop: XLA's annotation, or the `i < N` of a scan's condition
    (scans count from 0 by 1)."""
    if known := _TRIP_COUNT.search(loop.rest):
        return int(known[1])
    condition = re.search(r"\bcondition=%?([\w.\-]+)", loop.rest)
    if not condition or condition[1] not in module.computations:
        return None
    defs = module.defining(condition[1])
    for inst in defs.values():
        if inst.op == "compare" and "direction=LT" in inst.rest:
            for operand in inst.operands:
                source = defs.get(operand)
                # Look through copies and sharding annotations (shard_map wraps N in one).
                while source is not None and source.op in _PASS_THROUGH and source.operands:
                    source = defs.get(source.operands[0])
                if source is not None and source.op == "constant":
                    return int(source.rest.split(")")[0])
    return None


def executions(module: HloModule) -> tuple[dict[str, int], int]:
    """How many times each computation runs per call of the entry, and how many loops had no
    readable trip count (counted as running once)."""
    counts: dict[str, int] = collections.defaultdict(int)
    unknown = 0

    def visit(name: str, times: int) -> None:
        nonlocal unknown
        counts[name] += times
        for inst in module.computations.get(name, []):
            loop_trips = 1
            if inst.op == "while":
                found = trip_count(module, inst)
                unknown += found is None
                loop_trips = found or 1
            for kind, callee in called(inst):
                if callee in module.computations and kind != "condition":
                    visit(callee, times * (loop_trips if kind == "body" else 1))

    visit(module.entry, 1)
    return dict(counts), unknown


def called(inst: Instruction) -> list[tuple[str, str]]:
    """(kind, computation) pairs `inst` calls: while bodies and conditions, fusions, calls."""
    called = [(kind, c) for kind, c in _CALLED.findall(inst.rest)]
    for group in _CALLED_LISTS.findall(inst.rest):
        called += [("branch", c.strip().lstrip("%")) for c in group.split(",")]
    return called


def op_name(inst: Instruction) -> str:
    """The JAX op name in an instruction's metadata ("" without one): the trace's name scopes,
    `jit(step)/.../cond/branch_1_fun/...`."""
    found = _OP_NAME.search(inst.rest)
    return found[1] if found else ""


def manual_scale(module: HloModule) -> int:
    """How many devices share a shard_map body's work: its bodies see per-device shapes, so
    their FLOPs count this many times in the (otherwise global) lowered module. Read from the
    largest global/local size ratio of the values entering manual computations."""
    best = 1
    for name, instructions in module.computations.items():
        defs = None
        for inst in instructions:
            if inst.op == "custom-call" and "GlobalToLocalShape" in inst.rest:
                defs = defs or module.defining(name)
                globals_ = [arrays(defs[o].type)[0][1] for o in inst.operands if o in defs]
                for full, local in zip(globals_, (s for _, s in arrays(inst.type)), strict=False):
                    best = max(best, math.prod(full) // max(math.prod(local), 1))
    return best


def _inside_manual(module: HloModule) -> set[str]:
    """Computations reached from a shard_map body (the bodies included)."""
    found: set[str] = set()
    todo = [n for n in module.computations if _MANUAL_BODY in n]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for inst in module.computations.get(name, []):
            todo += [c for _, c in called(inst) if c in module.computations]
    return found


def _weighted(
    module: HloModule, ops: tuple[str, ...]
) -> Iterator[tuple[int, Instruction, dict[str, Instruction], int, str]]:
    """(times it runs, instruction, its computation's definitions, the devices sharing its
    shapes, the computation's name) for each instruction of `ops` in the lowered (global)
    module: shard_map bodies see one device's shapes, so they run once per body device."""
    counts, _ = executions(module)
    manual, scale = _inside_manual(module), manual_scale(module)
    for name, times in counts.items():
        sharing = scale if name in manual else 1
        defs = None
        for inst in module.computations[name]:
            if inst.op in ops:
                defs = defs or module.defining(name)
                yield times * sharing, inst, defs, sharing, name


def dot_flops(module: HloModule) -> tuple[float, int]:
    """Matmul FLOPs of one run of the lowered (global) module: 2 x output elements x contracted
    size per dot, each weighted by how often its computation runs; and the count of loops of
    unknown length. Grouped matmuls are `ragged_dot_flops`'."""
    total = 0.0
    for times, inst, defs, _, _ in _weighted(module, ("dot",)):
        lhs = defs.get(inst.operands[0])
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", inst.rest)
        if lhs is None or contracting is None:
            continue
        lhs_shape = arrays(lhs.type)[0][1]
        k = math.prod(lhs_shape[int(d)] for d in contracting[1].split(",") if d)
        total += times * 2.0 * math.prod(arrays(inst.type)[0][1]) * k
    return total, executions(module)[1]


def ragged_dot_flops(
    module: HloModule, expected_rows: float | None = None, kernel: GroupedKernel | None = None
) -> tuple[float, float]:
    """(expected, bound) FLOPs of the lowered module's grouped matmuls (`ragged-dot`, and the
    custom calls `kernel` knows). Each multiplies every row of its ragged dimension (the buffer
    the groups are cut from) by one group's weight: 2 x lhs elements x rhs free size, for
    `ragged-dot` (`kernel` says its kernels' own). `bound` is that for the whole
    buffer; only the rows the group sizes cover are work, and at balanced routing those are
    `expected_rows` globally (tokens x top_k: each pick is one row), so `expected` scales each
    op by min(1, expected_rows / its buffer's global rows)."""
    per_computation: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for times, inst, defs, sharing, where in _weighted(module, ("ragged-dot", "custom-call")):
        found = (
            _ragged_dot(inst, defs)
            if inst.op == "ragged-dot"
            else (kernel(inst, where) if kernel else None)
        )
        if found is None:
            continue
        flops, rows = times * found[0], found[1] * sharing
        share = 1.0 if expected_rows is None else min(1.0, expected_rows / rows)
        per_computation[where][0] += flops * share
        per_computation[where][1] += flops
    return _alternatives_once(module, per_computation)


def _ragged_dot(inst: Instruction, defs: dict[str, Instruction]) -> tuple[float, int] | None:
    """(FLOPs over its whole buffer, the buffer's rows) of one `ragged-dot`."""
    lhs, rhs = (defs.get(o) for o in inst.operands[:2])
    ragged = re.search(r"lhs_ragged_dims=\{([0-9,]*)\}", inst.rest)
    if lhs is None or rhs is None or ragged is None:
        return None
    lhs_shape, rhs_shape = arrays(lhs.type)[0][1], arrays(rhs.type)[0][1]
    fixed = set()
    for key in ("rhs_contracting_dims", "rhs_group_dims"):
        if found := re.search(key + r"=\{([0-9,]*)\}", inst.rest):
            fixed |= {int(d) for d in found[1].split(",") if d}
    free = math.prod(n for i, n in enumerate(rhs_shape) if i not in fixed)
    return 2.0 * math.prod(lhs_shape) * free, lhs_shape[int(ragged[1].split(",")[0])]


def _alternatives_once(
    module: HloModule, per_computation: dict[str, list[float]]
) -> tuple[float, float]:
    """Sums of per-computation (expected, bound), one branch of each conditional (one runs:
    the expert FFN's overflow exchange, or not): the bound the
    costlier, the expected count the branch traced as the one a step takes
    (`expected_branches`: the path balanced routing takes; the cheaper one where no branch is
    marked). A branch with no grouped matmul counts 0."""
    branch_of: dict[str, tuple[str, str]] = {}  # computation -> (conditional, its branch)
    branches: dict[str, dict[str, list[float]]] = collections.defaultdict(dict)
    expected: dict[str, str] = {}  # conditional -> its branch traced as the expected one

    def mark(name: str, key: tuple[str, str]) -> None:
        if name in branch_of or name not in module.computations:
            return
        branch_of[name] = key
        for inst in module.computations[name]:
            for _, callee in called(inst):
                mark(callee, key)

    def visit(name: str, seen: set[str]) -> None:
        for inst in module.computations.get(name, []):
            alternatives = []
            for kind, callee in called(inst):
                if callee in seen:
                    continue
                seen.add(callee)
                if inst.op == "conditional" and kind in (
                    "branch",
                    "true_computation",
                    "false_computation",
                ):
                    alternatives.append(callee)
                else:
                    visit(callee, seen)
            if alternatives:
                key = f"{name}/{inst.name}"
                for callee in alternatives:
                    mark(callee, (key, callee))
                    branches[key].setdefault(callee, [0.0, 0.0])
                taken = expected_branches(module, alternatives, op_name(inst))
                if len(taken) == 1:
                    expected[key] = taken[0]

    visit(module.entry, set())
    total = [0.0, 0.0]
    for name, (e, b) in per_computation.items():
        if name in branch_of:
            cond, branch = branch_of[name]
            branches[cond][branch][0] += e
            branches[cond][branch][1] += b
        else:
            total[0] += e
            total[1] += b
    for cond, alternatives in branches.items():
        total[0] += (
            alternatives[expected[cond]][0]
            if cond in expected
            else min(e for e, _ in alternatives.values())
        )
        total[1] += max(b for _, b in alternatives.values())
    return total[0], total[1]


def expected_branches(
    module: HloModule, branches: list[str], conditional_op_name: str
) -> list[str]:
    """The branches of a conditional traced as the one a step takes: under `EXPECTED_BRANCH`,
    else those not under `RARE_BRANCH` where a sibling is (`planner_hints`). An op's name
    below the conditional's own names the scope; one the conditional itself sits in marks
    every branch, so it is not counted."""

    def marked(branch: str, scope: str) -> bool:
        return any(
            f"/{scope}/" in op_name(i).removeprefix(conditional_op_name)
            for i in module.computations.get(branch, [])
        )

    expected = [b for b in branches if marked(b, EXPECTED_BRANCH)]
    if expected:
        return expected
    rare = [b for b in branches if marked(b, RARE_BRANCH)]
    return [b for b in branches if b not in rare] if rare else []


def replica_groups(inst: Instruction) -> list[list[int]]:
    """The device groups of a collective: explicit `{{0,1},{2,3}}` or iota `[2,4]<=[8]` /
    `[4,2]<=[2,4]T(1,0)`; collective-permute's source-target pairs count as groups of two."""
    text = inst.rest
    if m := re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text):
        shape = [int(x) for x in m[1].split(",")]
        ids = np.arange(math.prod(int(x) for x in m[2].split(","))).reshape(
            [int(x) for x in m[2].split(",")]
        )
        if m[3]:
            ids = ids.transpose([int(x) for x in m[3].split(",")])
        return ids.reshape(shape).tolist()
    if m := re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[0-9,{}]*\})\}", text):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m[1])]
    return []


def result_arrays(inst: Instruction, op: str) -> list[tuple[str, tuple[int, ...]]]:
    """The result arrays of a collective; an async `-start` op's type also holds its operands
    (all-gather: operands then results) or context scalars (collective-permute)."""
    found = arrays(inst.type)
    if inst.op.endswith("-start"):
        if op == "all-gather":
            return found[len(found) // 2 :]
        if op == "collective-permute":
            return found[1:2]
    return found


def collective_ops(module: HloModule) -> list[dict[str, Any]]:
    """Every collective instruction: op, result dtype and bytes per device, its device groups,
    and how many times it runs per step (`executions` > 1: inside a loop). Cross-slice
    (megascale) transfers carry `network: "dcn"`."""
    counts, _ = executions(module)
    found = []
    for name, times in counts.items():
        for inst in module.computations[name]:
            op = inst.op.removesuffix("-start")
            if dcn := MEGASCALE.search(inst.rest) if op == "send" else None:
                # Multislice: XLA:TPU hands cross-slice collectives to the megascale runtime as
                # host-transfer sends; their result's first array is the data sent.
                dtype, shape = arrays(inst.type)[0]
                found.append(
                    {
                        "op": dcn[1].lower().replace("_", "-"),
                        "dtype": dtype,
                        "executions": times,
                        "bytes": nbytes(dtype, shape),
                        "groups": [],
                        "group": 0,
                        "network": "dcn",
                    }
                )
            if op not in COLLECTIVE_OPS:
                continue
            sized = result_arrays(inst, op)
            if op == "ragged-all-to-all":
                sized = ragged_sent_arrays(inst, module.defining(name))
            for dtype in sorted({d for d, _ in sized}):
                found.append(
                    {
                        "op": op,
                        "dtype": dtype,
                        "executions": times,
                        "bytes": sum(nbytes(d, s) for d, s in sized if d == dtype),
                        "groups": replica_groups(inst),
                        "group": group_size(inst, 0),
                    }
                )
    return found


def ragged_sent_arrays(
    inst: Instruction, defs: dict[str, Instruction]
) -> list[tuple[str, tuple[int, ...]]]:
    """What a ragged all-to-all sends at balanced routing: the smaller of its operand and its
    result (each rank sends what it receives; a dispatch's operand is its picks, a combine's
    result; the other buffer is the worst-case receive buffer)."""
    result = arrays(inst.type)
    source = defs.get(inst.operands[0]) if inst.operands else None
    operand = arrays(source.type) if source is not None else result
    if inst.op.endswith("-start"):  # libtpu 0.0.50: ((input, output, 4 offsets), result, 2 u32)
        operand, result = result[:1], result[6:7]
    return min(operand, result, key=lambda found: sum(nbytes(d, s) for d, s in found))


def summarize(
    ops: list[dict[str, Any]], keys: tuple[str, ...] = ("op", "dtype")
) -> list[dict[str, Any]]:
    """Collectives grouped by `keys`: static `count`, per-step `executions`, result `bytes`
    (static sum) and `bytes_per_step` (weighted by executions)."""
    groups: dict[tuple, dict[str, Any]] = {}
    for c in ops:
        key = tuple(c[k] for k in keys)
        g = groups.setdefault(
            key,
            {
                **{k: c[k] for k in keys},
                "count": 0,
                "executions": 0,
                "bytes": 0,
                "bytes_per_step": 0,
            },
        )
        g["count"] += 1
        g["executions"] += c["executions"]
        g["bytes"] += c["bytes"]
        g["bytes_per_step"] += c["bytes"] * c["executions"]
    return [groups[k] for k in sorted(groups)]


def group_size(inst: Instruction, default: int) -> int:
    """Devices in each of a collective's groups: explicit or iota groups, or XLA:TPU's mesh
    form `replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}` (the named axes' product)."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", inst.rest):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m[1]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m[2]) if a in sizes)
    return max((len(g) for g in replica_groups(inst)), default=default)
