"""Figures read from HLO text: matmul FLOPs and collectives, counted per executed step.

XLA's `cost_analysis()` counts a while loop's body once, so for a step whose layers are scanned
it reports several times fewer FLOPs than run. Here every computation is weighted by how often
it runs: a while body by its trip count (from the loop condition's `i < N` or XLA's
`known_trip_count`), nested loops multiplied. Only dots are counted (the matmul FLOPs that MFU
is about); kernels in custom calls (Pallas) are invisible to it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

import numpy as np

COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                  "ragged-all-to-all", "collective-permute")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_CALLED_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_PASS_THROUGH = ("custom-call", "copy", "convert", "bitcast", "reshape")
_MANUAL_BODY = "manual_computation_body"  # a shard_map body, as JAX names it
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_HLO_ITEMSIZE = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1, "s16": 2,
                 "s32": 4, "s64": 8, "u8": 1, "u16": 2, "u32": 4, "u64": 8,
                 "f8e4m3fn": 1, "f8e5m2": 1}


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
                if operand := self.rest[start:end].strip():
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


def parse(text: str) -> HloModule:
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
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
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(hlo_type)]


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
                # Look through sharding annotations and copies (shard_map bodies wrap N in a
                # `Sharding` custom call).
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
            for kind, callee in _called(inst):
                if callee in module.computations and kind != "condition":
                    visit(callee, times * (loop_trips if kind == "body" else 1))

    visit(module.entry, 1)
    return dict(counts), unknown


def _called(inst: Instruction) -> list[tuple[str, str]]:
    """(kind, computation) pairs `inst` calls: while bodies and conditions, fusions, calls."""
    called = [(kind, c) for kind, c in _CALLED.findall(inst.rest)]
    for group in _CALLED_LISTS.findall(inst.rest):
        called += [("branch", c.strip().lstrip("%")) for c in group.split(",")]
    return called


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
                for full, local in zip(globals_, (s for _, s in arrays(inst.type)),
                                       strict=False):
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
            todo += [c for _, c in _called(inst) if c in module.computations]
    return found


def dot_flops(module: HloModule) -> tuple[float, int]:
    """Matmul FLOPs of one run of the lowered (global) module: 2 x output elements x contracted
    size per dot, each weighted by how often its computation runs, and shard_map bodies (which
    see one device's shapes) by the devices that share them; and the count of loops of unknown
    length."""
    counts, unknown = executions(module)
    manual, scale = _inside_manual(module), manual_scale(module)
    total = 0.0
    for name, times in counts.items():
        times *= scale if name in manual else 1
        defs = None
        for inst in module.computations[name]:
            if inst.op != "dot":
                continue
            defs = defs or module.defining(name)
            lhs = defs.get(inst.operands[0])
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", inst.rest)
            if lhs is None or contracting is None:
                continue
            lhs_shape = arrays(lhs.type)[0][1]
            k = math.prod(lhs_shape[int(d)] for d in contracting[1].split(",") if d)
            total += times * 2.0 * math.prod(arrays(inst.type)[0][1]) * k
    return total, unknown


def replica_groups(inst: Instruction) -> list[list[int]]:
    """The device groups of a collective: explicit `{{0,1},{2,3}}` or iota `[2,4]<=[8]` /
    `[4,2]<=[2,4]T(1,0)`; collective-permute's source-target pairs count as groups of two."""
    text = inst.rest
    if m := re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text):
        shape = [int(x) for x in m[1].split(",")]
        ids = np.arange(math.prod(int(x) for x in m[2].split(","))).reshape(
            [int(x) for x in m[2].split(",")])
        if m[3]:
            ids = ids.transpose([int(x) for x in m[3].split(",")])
        return ids.reshape(shape).tolist()
    if m := re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[0-9,{}]*\})\}", text):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m[1])]
    return []


def _result_arrays(inst: Instruction, op: str) -> list[tuple[str, tuple[int, ...]]]:
    """The result arrays of a collective; an async `-start` op's type also holds its operands
    (all-gather: operands then results) or context scalars (collective-permute)."""
    found = arrays(inst.type)
    if inst.op.endswith("-start"):
        if op == "all-gather":
            return found[len(found) // 2:]
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
            if dcn := _MEGASCALE.search(inst.rest) if op == "send" else None:
                # Multislice: XLA:TPU hands cross-slice collectives to the megascale runtime as
                # host-transfer sends; their result's first array is the data sent.
                dtype, shape = arrays(inst.type)[0]
                found.append({"op": dcn[1].lower().replace("_", "-"), "dtype": dtype,
                              "executions": times, "bytes": nbytes(dtype, shape),
                              "groups": [], "network": "dcn"})
            if op not in COLLECTIVE_OPS:
                continue
            for dtype in sorted({d for d, _ in _result_arrays(inst, op)}):
                found.append({"op": op, "dtype": dtype, "executions": times,
                              "bytes": sum(nbytes(d, s) for d, s in _result_arrays(inst, op)
                                           if d == dtype),
                              "groups": replica_groups(inst)})
    return found


def summarize(ops: list[dict[str, Any]], keys: tuple[str, ...] = ("op", "dtype")
              ) -> list[dict[str, Any]]:
    """Collectives grouped by `keys`: static `count`, per-step `executions`, result `bytes`
    (static sum) and `bytes_per_step` (weighted by executions)."""
    groups: dict[tuple, dict[str, Any]] = {}
    for c in ops:
        key = tuple(c[k] for k in keys)
        g = groups.setdefault(key, {**{k: c[k] for k in keys}, "count": 0, "executions": 0,
                                    "bytes": 0, "bytes_per_step": 0})
        g["count"] += 1
        g["executions"] += c["executions"]
        g["bytes"] += c["bytes"]
        g["bytes_per_step"] += c["bytes"] * c["executions"]
    return [groups[k] for k in sorted(groups)]
