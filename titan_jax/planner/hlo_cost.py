"""A step-time estimate read from the compiled (scheduled) TPU program, instruction by
instruction, with published chip constants only (`planner/topology.py`) and the rates the chip
sustains by size, from its maker's microbenchmarks (`planner/sustained.py`).

Each instruction that the schedule runs (fusions, custom calls such as splash and the grouped
matmuls, copies, ...) costs max(its MXU FLOPs at the share of the bf16 peak a matmul of its
size sustains, its HBM bytes at the HBM bandwidth an access of its size sustains); a loop body
counts once per iteration. MXU FLOPs are counted as the
systolic array spends them: a matmul dimension short of a whole multiple of the array's side
(128, or 256 on v6e) fills only part of it (splash's q k^T contracts over head_dim 128: half
of v6e's array). Bytes are the operands and results that live in HBM (memory space 0 in the
compiled layout: `S(1)` is on-chip VMEM, `S(5)` host memory); a fused operand read only
through a dynamic-slice counts as the slice, an in-place dynamic-update-slice (bare or a
fusion's root) as its update, a splash kernel's operand as often as its grid reads it. The
asynchronous copies XLA:TPU schedules between HBM and on-chip memory (`copy-start`/
`slice-start` ... `-done`: operand prefetches and evictions) move HBM bytes too: the
instructions between a copy's start and its done take at least their own HBM bytes plus the
copy's at the HBM bandwidth. Transfers to and from host memory (`S(5)`: offloaded
activations, XLA:TPU's `async-start` of a dynamic-(update-)slice of a host buffer, or a copy)
cross the host link (PCIe) one at a time at its bandwidth, hidden only by the work the
schedule places between their start and their done. Collectives cost their ring-algorithm
bytes at the ICI bandwidth of the links their algorithm uses, at the share a transfer of
their size sustains (a bidirectional ring: two links, one way each, per torus
dimension it spans, or one link one way where no wraparound link closes the ring;
`Chip.ring_bytes_per_s`, `TpuSlice.ring_wraps`), or at the DCN bandwidth, and are added only
where the schedule leaves them exposed: a synchronous collective is exposed in full; an
asynchronous one (XLA:TPU's `async-collective-start` ... continuation fusions ...
`async-collective-done` chains, or `*-start`/`*-done` pairs) is covered by the estimated work
the schedule places between its start and its done.
It prices what a step runs at the assumptions MFU is quoted at: a `conditional` costs the
branch the code traced as the one a step takes (`planner_hints`: a finite loss, balanced
expert routing), and a grouped matmul the row tiles balanced routing fills (`routed_rows`), not its
worst-case buffer. Seconds are also reported by op class (`op_class`, exposed collectives by
kind).
It is an estimate: elementwise work on the vector units is priced by its HBM bytes only
(Google publishes no vector-unit throughput), and clock throttling not at all; its band is
the calibration's (`planner/calibration.py`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from titan_jax.planner import hlo_stats, kernel_flops, sustained
from titan_jax.planner.hlo_stats import HloModule, Instruction
from titan_jax.planner.mxu_work import computation_work, instruction_work
from titan_jax.planner.topology import Chip

_ARRAY_LAYOUT = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_HOST = "5"  # XLA:TPU's memory space of pinned host memory (offloaded values)
_CHAIN = re.compile(r'chain_id="(\d+)"')
_FREE = (
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "copy-start",
    "copy-done",
    "slice-start",
    "slice-done",
    "opt-barrier",
    "add-dependency",
    "async-start",
    "async-update",
    "async-done",
    # another thread's work (Ironwood's SparseCore gathers), waited for at the done
    "call-start",
    "call-update",
    "call-done",
)
_COLLECTIVE = tuple(hlo_stats.COLLECTIVE_OPS)
# XLA:TPU's allocation of an uninitialised buffer (one that a loop or an in-place update then
# fills): it reserves memory and moves no byte.
_ALLOCATION = re.compile(r'custom_call_target="AllocateBuffer"')


def hbm_bytes(hlo_type: str) -> int:
    """Bytes of the arrays of `hlo_type` that live in HBM (default memory space)."""
    total = 0
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(hlo_type):
        space = _MEMORY_SPACE.search(layout or "")
        if space is None or space[1] == "0":
            total += hlo_stats.nbytes(dtype, tuple(int(d) for d in dims.split(",") if d))
    return total


def _fused_operand_bytes(module: HloModule, fused: str, index: int, full: int) -> int:
    """What a fusion reads of its operand `index`: the slices when the fused computation reads
    it only through dynamic-slices (a scan reading one layer of a stacked weight or of the
    stacked saved activations), directly or inside a nested fusion."""
    insts = module.computations.get(fused, [])
    param = next((i for i in insts if i.op == "parameter" and i.rest.startswith(f"{index})")), None)
    if param is None:
        return full
    users = [i for i in insts if param.name in i.operands]
    if users and all(u.op == "dynamic-update-slice" and u.operands[0] == param.name for u in users):
        return 0  # updated in place: not read
    read = 0
    for user in users:
        nested = next((c for kind, c in hlo_stats.called(user) if kind == "calls"), None)
        if user.op == "dynamic-slice" and user.operands[0] == param.name:
            read += hbm_bytes(user.type)
        elif user.op == "fusion" and nested and user.operands.count(param.name) == 1:
            read += _fused_operand_bytes(module, nested, user.operands.index(param.name), full)
        else:
            return full
    return min(read, full) if users else full


def traffic(module: HloModule, inst: Instruction, defs: dict[str, Instruction]) -> float:
    """HBM bytes an instruction reads and writes. A dynamic-update-slice (bare, or a fusion's
    root) updates its buffer in place: it reads and writes the update only. A splash kernel
    reads its HBM operands as often as its grid visits them (`splash_read_factors`)."""
    if inst.op == "dynamic-update-slice" and len(inst.operands) > 1:
        update = defs.get(inst.operands[1])
        if update is None:
            return 0
        written = sum(hlo_stats.nbytes(d, s) for d, s in hlo_stats.arrays(update.type))
        return hbm_bytes(update.type) + (written if hbm_bytes(inst.type) else 0)
    fused = next((c for kind, c in hlo_stats.called(inst) if kind == "calls"), None)
    rereads = kernel_flops.splash_read_factors(inst) or []
    read = 0.0
    for index, operand in enumerate(inst.operands):
        source = defs.get(operand)
        if source is None:
            continue
        full = hbm_bytes(source.type)
        read += (
            full if fused is None or not full else _fused_operand_bytes(module, fused, index, full)
        )
        read += full * (rereads[index] - 1) if index < len(rereads) else 0
    written = hbm_bytes(inst.type)
    root = module.computations.get(fused, [])[-1:] if fused else []
    if fused and root and root[0].op == "dynamic-update-slice":
        update = module.defining(fused).get(root[0].operands[1])
        written = hbm_bytes(update.type) if update is not None else written
    return read + written


def _space(layout: str) -> str:
    return (_MEMORY_SPACE.search(layout or "") or ["", "0"])[1]


class Dma(NamedTuple):
    """What an asynchronous copy moves: HBM bytes, host-link bytes, and which way over the
    host link (a full-duplex link: each way has its bandwidth)."""

    hbm_bytes: int
    host_bytes: int = 0
    to_host: bool = False


def dma_bytes(module: HloModule, inst: Instruction) -> Dma:
    """What an asynchronous copy moves (`Dma`). `copy-start` (destination,
    source, context) and `slice-start` ((source), destination slice, context): XLA:TPU's
    prefetches of operands into on-chip memory (S(1)), evictions back, and transfers to or
    from host memory (S(5)); `async-start` of a dynamic-slice or dynamic-update-slice whose
    buffer is in host memory: an offloaded value read back or written out a layer at a time.
    The moved piece's bytes once per side that is HBM (an HBM-to-HBM copy reads and writes),
    and once over the host link when either side is host memory."""
    if inst.op == "async-start":
        return _host_slice_bytes(module, inst)
    found = _ARRAY_LAYOUT.findall(inst.type)
    if len(found) < 2:
        return Dma(0)
    pair = found[:2] if inst.op == "copy-start" else found[1:0:-1]  # destination, source
    size = hlo_stats.nbytes(pair[0][0], tuple(int(d) for d in pair[0][1].split(",") if d))
    spaces = [_space(layout) for _, _, layout in pair]
    return Dma(size * spaces.count("0"), size if _HOST in spaces else 0, spaces[0] == _HOST)


def _host_slice_bytes(module: HloModule, inst: Instruction) -> Dma:
    """What an `async-start` whose computation slices a host buffer (`dynamic-slice`: the
    slice arrives) or updates one in place (`dynamic-update-slice`: the update leaves) moves;
    nothing for any other."""
    callee = next((c for kind, c in hlo_stats.called(inst) if kind == "calls"), None)
    root = module.computations.get(callee, [])[-1:] if callee else []
    if not callee or not root or root[0].op not in ("dynamic-slice", "dynamic-update-slice"):
        return Dma(0)
    defs = module.defining(callee)
    buffer = defs.get(root[0].operands[0])
    layouts = _ARRAY_LAYOUT.findall(buffer.type) if buffer else []
    if _HOST not in [_space(layout) for _, _, layout in layouts]:
        return Dma(0)
    to_host = root[0].op == "dynamic-update-slice"
    piece = defs.get(root[0].operands[1]) if to_host else root[0]
    if piece is None:
        return Dma(0)
    size = sum(hlo_stats.nbytes(d, s) for d, s in hlo_stats.arrays(piece.type))
    return Dma(hbm_bytes(piece.type), size, to_host)


def chains(module: HloModule, inst: Instruction) -> set[str]:
    """The async collective chains an instruction takes part in (XLA:TPU's chain_id)."""
    found = set(_CHAIN.findall(inst.rest))
    for kind, callee in hlo_stats.called(inst):
        if kind == "calls":
            for inner in module.computations.get(callee, []):
                if inner.op in _COLLECTIVE:
                    found |= set(_CHAIN.findall(inner.rest))
    return found


def moved_bytes(op: str, result_bytes: float, group: int) -> float:
    """Bytes one device sends for a collective with a ring algorithm over `group` devices."""
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    return {
        "all-gather": result_bytes * share,
        "reduce-scatter": result_bytes * (group - 1),  # the result is one shard
        "all-reduce": 2 * result_bytes * share,
        "all-to-all": result_bytes * share,
        # counted by what it sends (see collective_bytes), not its buffer
        "ragged-all-to-all": result_bytes * share,
        "collective-permute": float(result_bytes),
    }[op]


def collective_bytes(inst: Instruction, op: str, defs: dict[str, Instruction]) -> int:
    """Bytes per device a collective's ring is sized by: its result, except a ragged
    all-to-all: what it sends at balanced routing (`hlo_stats.ragged_sent_arrays`)."""
    if op == "ragged-all-to-all":
        return sum(hlo_stats.nbytes(d, s) for d, s in hlo_stats.ragged_sent_arrays(inst, defs))
    return sum(hlo_stats.nbytes(d, s) for d, s in hlo_stats.result_arrays(inst, op))


class _Walk:
    """One pass over the scheduled control flow: per-instruction seconds, and each collective
    with the compute the schedule places under it."""

    def __init__(
        self,
        module: HloModule,
        chip: Chip,
        devices: int,
        rings: dict[str, tuple[int, ...]],
        ring_wraps: Callable[[tuple[int, ...]], bool],
        routed_rows: float | None = None,
        costlier_branches: bool = False,
    ):
        self.module, self.chip, self.devices = module, chip, devices
        self.routed_rows, self.costlier_branches = routed_rows, costlier_branches
        self.rings, self.ring_wraps = rings, ring_wraps
        self.matmul_share = functools.partial(sustained.matmul_share, chip.generation)
        self.rings_by_group = {
            hlo_stats.group_size(inst, devices): rings[inst.name]
            for insts in module.computations.values()
            for inst in insts
            if inst.name in rings and "replica_groups=" in inst.rest
        }
        self.memo: dict[str, tuple[float, float]] = {}
        self.flops = self.hbm = self.compute_s = self.exposed_s = self.dma_s = 0.0
        self.host_bytes = 0.0  # over the host link (offloaded values)
        # as XLA's cost_analysis() counts: each loop body once, kernels as they declare
        self.flops_once = self.hbm_once = 0.0
        self.collectives: list[dict[str, Any]] = []
        self.conditionals: list[dict[str, Any]] = []
        self.by_class: dict[str, float] = {}  # seconds per op class (`op_class`)

    def _totals(self) -> tuple[Any, ...]:
        return (
            self.flops,
            self.hbm,
            self.compute_s,
            self.exposed_s,
            self.dma_s,
            self.host_bytes,
            self.flops_once,
            self.hbm_once,
            list(self.collectives),
            list(self.conditionals),
            dict(self.by_class),
        )

    def _restore(self, totals: tuple[Any, ...]) -> None:
        (
            self.flops,
            self.hbm,
            self.compute_s,
            self.exposed_s,
            self.dma_s,
            self.host_bytes,
            self.flops_once,
            self.hbm_once,
            collectives,
            conditionals,
            by_class,
        ) = totals
        self.collectives, self.conditionals = list(collectives), list(conditionals)
        self.by_class = dict(by_class)

    def _charge(self, op_class: str, seconds: float) -> None:
        self.by_class[op_class] = self.by_class.get(op_class, 0.0) + seconds

    def conditional(self, inst: Instruction, times: float) -> float:
        """Seconds of the branch a step takes: the one traced as such
        (`planner_hints`: a finite loss, balanced routing), else (or when pricing the bound:
        `costlier_branches`) the costlier. Only that branch's FLOPs, bytes and collectives
        count; each other is reported beside it (`conditionals`)."""
        before = self._totals()
        branches = []  # (computation, seconds, totals after it)
        for kind, name in hlo_stats.called(inst):
            if kind in ("branch", "true_computation", "false_computation"):
                seconds = self.visit(name, times)
                branches.append((name, seconds, self._totals()))
                self._restore(before)
        if not branches:
            return 0.0
        own = hlo_stats.op_name(inst)
        marked = hlo_stats.expected_branches(self.module, [b[0] for b in branches], own)
        expected = [b for b in branches if b[0] in marked]
        taken = (
            expected[0]
            if len(expected) == 1 and not self.costlier_branches
            else max(branches, key=lambda b: b[1])
        )
        self._restore(taken[2])
        self.conditionals.append(
            {
                "name": inst.name,
                "executions": times,
                "branch": taken[0],
                "seconds": taken[1],
                "expected": taken in expected,
                "others": [
                    {"branch": name, "seconds": s} for name, s, _ in branches if name != taken[0]
                ],
            }
        )
        return taken[1]

    def collective(
        self, inst: Instruction, op: str, defs: dict[str, Instruction], owner: str = ""
    ) -> dict[str, Any]:
        """A collective's bytes and seconds on the network: over ICI, rings over the torus
        dimensions its algorithm spans (`rings` of it or of the fusion `owner` that runs it;
        else those the compiler chose for another collective over groups of the same size, as
        for the async gather fusions, which name no algorithm; else one ring of the group's
        chips: SparseCore-offloaded collectives name none), closed by wraparound links or not
        (`ring_wraps`)."""
        dcn = op == "send"
        group = hlo_stats.group_size(inst, self.devices)
        size = (
            collective_bytes(inst, op, defs)
            if not dcn
            else hlo_stats.nbytes(*hlo_stats.arrays(inst.type)[0])
        )
        moved = moved_bytes(op, size, group) if not dcn else float(size)
        # One ring of the group: its chips (Ironwood's two TensorCores share a chip's links).
        whole = (max(1, group // self.chip.devices_per_chip),)
        sizes = (
            self.rings.get(owner)
            or self.rings.get(inst.name)
            or self.rings_by_group.get(group)
            or whole
        )
        sizes = whole if sizes == (0,) else sizes  # a 1-D emitter: one ring of the group
        wraps = self.ring_wraps(sizes)
        link = self.chip.dcn_bytes_per_s if dcn else self.chip.ring_bytes_per_s(len(sizes), wraps)
        bandwidth = link if dcn else self.sustained_ring(link, moved)
        return {
            "op": op,
            "name": owner or inst.name,
            "bytes": size,
            "group": group,
            "ring_dims": len(sizes),
            "wraparound": wraps,
            "link_bytes_per_s": link,
            "bytes_per_s": bandwidth,
            "seconds": moved / bandwidth,
            "covered_s": 0.0,
        }

    def sustained_ring(self, link_bytes_per_s: float, moved: float) -> float:
        """The bandwidth a ring sustains on its links when a device sends `moved` bytes."""
        return link_bytes_per_s * sustained.collective_share(self.chip.generation, moved)

    def visit(self, name: str, times: float) -> float:
        """Seconds of one run of control computation `name` (loops inside included)."""
        defs = self.module.defining(name)
        spans: dict[str, list] = {}  # chain or start name -> [collective, first, last]
        follows: dict[str, str] = {}  # an async call's update -> its start
        dmas: dict[str, list] = {}  # copy/slice/async-start name -> [Dma, first, last]
        seconds: list[float] = []
        moved: list[float] = []  # HBM bytes of each position (a loop: all its iterations)
        exposed = 0.0
        for position, inst in enumerate(self.module.computations.get(name, [])):
            before = self.hbm
            seconds.append(self.run(inst, defs, times))
            moved.append((self.hbm - before) / times)
            if inst.op in ("copy-start", "slice-start", "async-start") and (
                (dma := dma_bytes(self.module, inst)).hbm_bytes or dma.host_bytes
            ):
                dmas[inst.name] = [dma, position, position]
            elif (
                inst.op in ("copy-done", "slice-done", "async-done")
                and (started := follows.get(inst.operands[0], inst.operands[0])) in dmas
            ):
                dmas[started][2] = position
            elif inst.op == "async-update" and inst.operands[0] in dmas:
                follows[inst.name] = inst.operands[0]
            op = inst.op.removesuffix("-start")
            fused = chains(self.module, inst)
            started = follows.get(inst.operands[0], inst.operands[0]) if inst.operands else ""
            if inst.op.endswith(("-done", "-update")) and started in spans:
                spans[started][2] = position
                follows[inst.name] = started
            elif op in _COLLECTIVE and inst.op.endswith("-start"):
                spans[inst.name] = [self.collective(inst, op, defs), position, position]
            elif inst.op in ("async-start", "call-start") and (
                inner := self.fused_collective(inst)
            ):
                spans[inst.name] = [inner, position, position]
            elif (op in _COLLECTIVE or op == "send") and not fused:
                dcn = op == "send" and hlo_stats.MEGASCALE.search(inst.rest)
                if op != "send" or dcn:
                    exposed += self.expose(self.collective(inst, op, defs), times, name)
            elif inst.op == "fusion" and not fused and (inner := self.fused_collective(inst)):
                exposed += self.expose(inner, times, name)
            for chain in fused:
                if chain not in spans:
                    spans[chain] = [self.fused_collective(inst), position, position]
                spans[chain][2] = position
        self.share_hbm(dmas, seconds, moved, times)
        self.wait_for_host(dmas, seconds, times)
        for found, first, last in spans.values():
            found["covered_s"] = sum(seconds[first : last + 1])
            exposed += self.expose(found, times, name)
        return sum(seconds) + exposed

    def share_hbm(
        self, dmas: dict[str, list], seconds: list[float], moved: list[float], times: float
    ) -> None:
        """An asynchronous copy shares HBM with the instructions scheduled between its start
        and its done: that window takes at least all their HBM bytes and the copy's at the
        HBM bandwidth; any shortfall is added at the done (which waits for the copy)."""
        for dma, first, last in sorted(dmas.values(), key=lambda d: d[2]):
            size = dma.hbm_bytes
            window = sum(moved[first : last + 1]) + size
            need = window / (
                self.chip.hbm_bytes_per_s * sustained.hbm_share(self.chip.generation, window)
            )
            extra = max(0.0, need - sum(seconds[first : last + 1]))
            seconds[last] += extra
            moved[last] += size
            self.hbm += times * size
            self.compute_s += times * extra
            self.dma_s += times * extra
            self._charge("waiting on HBM copies", times * extra)

    def wait_for_host(self, dmas: dict[str, list], seconds: list[float], times: float) -> None:
        """Transfers to and from host memory cross the chip's host link (PCIe), each way one
        transfer after another, each from its start (or when its way frees) at the link's
        bandwidth; the done of one that has not arrived by then waits for it. Only the
        instructions the schedule places between a transfer's start and its done hide it."""
        rate = sustained.HOST_LINK_BYTES_PER_S.get(self.chip.generation)
        transfers = sorted(
            (first, last, dma.host_bytes, dma.to_host)
            for dma, first, last in dmas.values()
            if dma.host_bytes
        )
        if not rate or not transfers:
            return
        rate /= self.chip.devices_per_chip  # tpu7x: the chip's link serves both TensorCores
        arrives: dict[int, float] = {}  # done position -> when its last transfer arrives
        clock = 0.0
        link_free = {True: 0.0, False: 0.0}  # each way of the link: when it frees
        pending = iter(transfers)
        upcoming = next(pending, None)
        for position in range(len(seconds)):
            while upcoming and upcoming[0] == position:
                first, last, host, to_host = upcoming
                link_free[to_host] = max(clock, link_free[to_host]) + host / rate
                arrives[last] = max(arrives.get(last, 0.0), link_free[to_host])
                self.host_bytes += times * host
                upcoming = next(pending, None)
            wait = max(0.0, arrives.get(position, 0.0) - clock)
            seconds[position] += wait
            clock += seconds[position]
            if wait:
                self.compute_s += times * wait
                self.dma_s += times * wait
                self._charge("waiting on host transfers", times * wait)

    def fused_collective(self, inst: Instruction) -> dict[str, Any] | None:
        """The collective a fusion (or an asynchronous call: XLA:TPU on Ironwood runs the
        FSDP all-gathers on the SparseCores, `call-start(), async_execution_thread=
        "sparsecore", to_apply=` a computation holding the gather, or `async-start(...),
        calls=` one that calls it) runs, if any. XLA:TPU's `all-reduce-scatter` fusions (an
        all-reduce whose result is sliced to this device's shard) are reduce-scatters."""
        found = self._called_collective(inst)
        if found is None:
            return None
        inner, callee = found
        defs = self.module.defining(callee)
        if callee.startswith("all-reduce-scatter"):
            found = self.collective(inner, "all-reduce", defs, inst.name)
            size = sum(hlo_stats.nbytes(d, s) for d, s in hlo_stats.arrays(inst.type))
            moved = moved_bytes("reduce-scatter", size, found["group"])
            rate = self.sustained_ring(found["link_bytes_per_s"], moved)
            return {
                **found,
                "op": "reduce-scatter",
                "bytes": size,
                "bytes_per_s": rate,
                "seconds": moved / rate,
            }
        return self.collective(inner, inner.op.removesuffix("-start"), defs, inst.name)

    def _called_collective(self, inst: Instruction) -> tuple[Instruction, str] | None:
        """The first collective in the computations `inst` calls, through nested calls and
        fusions, with the computation that holds it."""
        for kind, callee in hlo_stats.called(inst):
            if not (kind == "calls" or (kind == "to_apply" and inst.op in ("call-start", "call"))):
                continue
            for inner in self.module.computations.get(callee, []):
                if inner.op.removesuffix("-start") in _COLLECTIVE:
                    return inner, callee
                if inner.op in ("call", "fusion") and (found := self._called_collective(inner)):
                    return found
        return None

    def expose(self, found: dict[str, Any], times: float, computation: str) -> float:
        """Records a collective; returns its seconds the schedule leaves uncovered."""
        exposed = max(0.0, found["seconds"] - found["covered_s"])
        self.exposed_s += times * exposed
        self._charge(f"exposed {found['op']}", times * exposed)
        found.update(
            executions=times,
            computation=computation,
            overlap=min(1.0, found["covered_s"] / found["seconds"]) if found["seconds"] else 1.0,
        )
        self.collectives.append(found)
        return exposed

    def run(self, inst: Instruction, defs: dict[str, Instruction], times: float) -> float:
        """Seconds of one execution of a scheduled instruction (a loop: all its iterations)."""
        if inst.op == "while":
            body = re.search(r"\bbody=%?([\w.\-]+)", inst.rest)
            trips = hlo_stats.trip_count(self.module, inst) or 1
            return trips * self.visit(body[1], times * trips) if body else 0.0
        if inst.op == "conditional":
            return self.conditional(inst, times)
        if inst.op == "call":
            return sum(
                self.visit(c, times)
                for k, c in hlo_stats.called(inst)
                if k in ("to_apply", "calls")
            )
        op = inst.op.removesuffix("-start").removesuffix("-done")
        if (
            inst.op in _FREE
            or op in _COLLECTIVE
            or op in ("send", "recv")
            or _ALLOCATION.search(inst.rest)
        ):
            return 0.0
        factors = self.chip.mxu_time_factors
        share = self.matmul_share
        own_flops, own_array = instruction_work(inst, defs, self.chip.mxu_dim, factors, share)
        hbm = traffic(self.module, inst, defs)
        rows = kernel_flops.grouped_rows(inst)
        if rows and self.routed_rows:  # it visits only the row tiles its groups cover
            covered = min(1.0, self.routed_rows / rows)
            own_flops, own_array = own_flops * covered, own_array * covered
            hbm -= (1 - covered) * _row_bytes(inst, defs, rows)
        work = [(own_flops, own_array)] + [
            computation_work(self.module, c, self.memo, self.chip.mxu_dim, factors, share)
            for k, c in hlo_stats.called(inst)
            if k == "calls"
        ]
        flops, array_flops = sum(w[0] for w in work), sum(w[1] for w in work)
        self.flops += times * flops
        self.hbm += times * hbm
        once = flops - (own_flops if inst.op == "custom-call" else 0.0)
        if declared := kernel_flops.megablox_flops(inst):  # a kernel that declares its cost
            once += declared[0]  # to XLA: its whole buffer (megablox's pl.CostEstimate)
        self.flops_once += once
        self.hbm_once += hbm
        hbm_rate = self.chip.hbm_bytes_per_s * sustained.hbm_share(self.chip.generation, hbm)
        spent = max(array_flops / self.chip.peak_bf16_flops, hbm / hbm_rate)
        self.compute_s += times * spent
        self._charge(op_class(inst, bool(rows), flops), times * spent)
        return spent


def op_class(inst: Instruction, grouped: bool, flops: float) -> str:
    """What kind of work a priced instruction is, for the time-by-class report: the experts'
    grouped matmuls, the attention kernels, other matmuls (fusions with MXU work), sorts,
    copies, and the rest (elementwise, reductions, gathers and scatters)."""
    if grouped:
        return "grouped matmuls"
    if inst.op == "custom-call" and kernel_flops.splash_flops(inst):
        return "attention kernels"
    if flops:
        return "matmuls"
    if inst.op == "sort":
        return "sorts"
    if inst.op in ("copy", "transpose"):
        return "copies"
    return "elementwise and other"


def _row_bytes(inst: Instruction, defs: dict[str, Instruction], rows: int) -> int:
    """HBM bytes of a grouped matmul's operands and results that have one row per buffer row
    (its tokens' sides; not the experts' weights)."""
    total = 0
    for hlo_type in [defs[o].type for o in inst.operands if o in defs] + [inst.type]:
        for dtype, dims, layout in _ARRAY_LAYOUT.findall(hlo_type):
            shape = tuple(int(d) for d in dims.split(",") if d)
            space = _MEMORY_SPACE.search(layout or "")
            if shape and shape[0] == rows and (space is None or space[1] == "0"):
                total += hlo_stats.nbytes(dtype, shape)
    return total


def estimate(
    program: str | HloModule,
    chip: Chip,
    devices: int,
    rings: dict[str, tuple[int, ...]] | None = None,
    ring_wraps: Callable[[tuple[int, ...]], bool] = lambda sizes: True,
    routed_rows: float | None = None,
    costlier_branches: bool = False,
) -> dict[str, Any]:
    """The compiled step's (HLO text, or parsed) estimated time per chip: `step_s` =
    `compute_s` (each instruction at max(FLOPs at the sustained matmul rate, HBM bytes at the
    sustained bandwidth), with the waits on HBM copies and host transfers) +
    `exposed_collective_s`; `collectives` lists each with its `seconds` on the network and the
    `overlap` share its schedule covers.
    `rings`: the ring sizes of each collective's algorithm, one per torus dimension it spans,
    by instruction name (`rings`, from the compiler's codegen dump); `ring_wraps`: whether
    rings of those sizes are closed by wraparound links (`TpuSlice.ring_wraps`; default: a
    torus). `routed_rows`: the rows a device's grouped matmuls cover at balanced routing (its
    picks, tokens x top_k); each is priced at that share of its buffer (FLOPs and the bytes of
    its row-shaped operands and results). A conditional is priced by the branch a step takes
    (`_Walk.conditional`), the others listed in `conditionals`; `costlier_branches` prices
    every conditional by its costlier branch instead (with no `routed_rows`: a MoE step's
    bound, every pick routed to one rank). `flops_loop_bodies_once` and
    `hbm_bytes_loop_bodies_once` count as XLA's `cost_analysis()` does (each loop body once;
    of the custom-call kernels, only those that declare their cost to XLA, megablox's grouped
    matmuls, at their whole buffer), to hold beside it."""
    module = hlo_stats.parse(program) if isinstance(program, str) else program
    walk = _Walk(module, chip, devices, rings or {}, ring_wraps, routed_rows, costlier_branches)
    step_s = walk.visit(module.entry, 1)
    return {
        "step_s": step_s,
        "compute_s": walk.compute_s,
        "exposed_collective_s": walk.exposed_s,
        "dma_wait_s": walk.dma_s,
        "host_transfer_bytes_per_chip": walk.host_bytes,
        "flops_loop_bodies_once": walk.flops_once,
        "hbm_bytes_loop_bodies_once": walk.hbm_once,
        "flops_per_chip": walk.flops,
        "hbm_bytes_per_chip": walk.hbm,
        "collectives": walk.collectives,
        "conditionals": walk.conditionals,
        "seconds_by_class": walk.by_class,
    }


_STRATEGY = re.compile(
    r'^\s*(?:ROOT )?%([\w.\-]+) = .*?"strategy":"Strategy\w*","debug":"'
    r"\\nStrategy\w*\{[^}]*?cores:\{([0-9 ]+)\}",
    re.M,
)
_GATHER_EMITTER = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?"emitter":"(\d)DAllGather', re.M)


def rings(codegen_text: str) -> dict[str, tuple[int, ...]]:
    """The rings each collective's algorithm runs, one size per torus dimension it spans,
    from XLA:TPU's codegen dump (its backend config names the strategy: `StrategyRing{...
    cores:{8}}` is one ring of 8, `StrategyND{... cores:{2 2}}` rings of 2 over two
    dimensions; all-gathers name only an emitter, `1DAllGatherOnMajorDim`, `2DAllGather...`:
    sizes 0, unknown)."""
    found = {name: (0,) * int(dims) for name, dims in _GATHER_EMITTER.findall(codegen_text)}
    return found | {
        name: tuple(int(c) for c in cores.split() if int(c) > 1) or (1,)
        for name, cores in _STRATEGY.findall(codegen_text)
    }
