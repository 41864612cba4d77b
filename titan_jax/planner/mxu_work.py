"""The MXU work of compiled HLO instructions: FLOPs, and the FLOPs as the systolic array
spends them, in bf16-peak time (a matmul dimension short of a whole multiple of the array's
side fills only part of it; int8 or fp8 operands run at the chip's faster rate for them,
`Chip.mxu_time_factors`; an instruction sustains the share of peak its size reaches on the
chip's published curve, `sustained.matmul_share`). Dots, XLA:TPU's matmul-shaped
convolutions and the kernels `kernel_flops` knows."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from titan_jax.planner import hlo_stats, kernel_flops
from titan_jax.planner.hlo_stats import HloModule, Instruction


def _dims(text: str, key: str) -> list[int]:
    found = re.search(key + r"=\{([0-9,]*)\}", text)
    return [int(d) for d in found[1].split(",") if d] if found else []


Share = Callable[[float], float]  # the share of peak a matmul of so many FLOPs sustains


def _full(flops: float) -> float:
    return 1.0


def _matmul_work(
    flops: float,
    m: int,
    n: int,
    k: int,
    mxu_dim: int,
    time_factor: float = 1.0,
    share: Share = _full,
) -> tuple[float, float]:
    """(FLOPs, FLOPs as the MXU spends them): a weight-stationary systolic array holds a
    (contraction x one free dim) tile, so a contraction of k fills k of its depth and the
    better-filling free dim (the compiler picks which operand stays) the other side.
    time_factor: the operands' time per FLOP over bf16's (0.5 for int8 on v6e); share: the
    share of peak the instruction sustains at its size."""
    fill = kernel_flops.array_efficiency(k, mxu_dim) * max(
        kernel_flops.array_efficiency(m, mxu_dim), kernel_flops.array_efficiency(n, mxu_dim)
    )
    return flops, flops / fill * time_factor / share(flops)


def _time_factor(operands: list[Instruction], factors: dict[str, float]) -> float:
    """The factor both operands' element type has (int8 x int8, fp8 x fp8), else 1."""
    kinds = {factors.get(hlo_stats.arrays(o.type)[0][0], 1.0) for o in operands}
    return kinds.pop() if len(kinds) == 1 else 1.0


def _dot_work(
    inst: Instruction,
    defs: dict[str, Instruction],
    mxu_dim: int,
    factors: dict[str, float],
    share: Share,
) -> tuple[float, float]:
    operands = [defs[o] for o in inst.operands[:2] if o in defs]
    contracting = _dims(inst.rest, "lhs_contracting_dims")
    if len(operands) < 2 or not contracting:
        return 0.0, 0.0
    lhs = hlo_stats.arrays(operands[0].type)[0][1]
    rhs = hlo_stats.arrays(operands[1].type)[0][1]
    k = math.prod(lhs[d] for d in contracting)
    m = math.prod(
        lhs[d] for d in range(len(lhs)) if d not in contracting + _dims(inst.rest, "lhs_batch_dims")
    )
    n = math.prod(
        rhs[d]
        for d in range(len(rhs))
        if d not in _dims(inst.rest, "rhs_contracting_dims") + _dims(inst.rest, "rhs_batch_dims")
    )
    flops = 2.0 * math.prod(hlo_stats.arrays(inst.type)[0][1]) * k
    return _matmul_work(flops, m, n, k, mxu_dim, _time_factor(operands, factors), share)


def _conv_work(
    inst: Instruction,
    defs: dict[str, Instruction],
    mxu_dim: int,
    factors: dict[str, float],
    share: Share,
) -> tuple[float, float]:
    """2 x output elements x (kernel input features x the window taps that meet the input,
    not padding nor the holes of a dilated input): XLA:TPU writes some matmuls as padded
    convolutions, and a batched one as a base-dilated convolution whose window meets one
    input element per batch entry (window 65536, lhs_dilate 65536)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.rest)
    operands = [defs[o] for o in inst.operands[:2] if o in defs]
    if labels is None or len(operands) < 2:
        return 0.0, 0.0
    lhs_shape = hlo_stats.arrays(operands[0].type)[0][1]
    rhs_shape = hlo_stats.arrays(operands[1].type)[0][1]
    dilation = re.search(r"\blhs_dilate=([0-9x]+)", inst.rest)
    lhs_dilate = [int(d) for d in dilation[1].split("x")] if dilation else []
    taps = 1
    for i, label in enumerate(labels[2]):
        if label.isdigit():
            spatial = lhs_shape[labels[1].index(label)]
            dilate = lhs_dilate[int(label)] if int(label) < len(lhs_dilate) else 1
            taps *= min(math.ceil(rhs_shape[i] / dilate), spatial)
    features = rhs_shape[labels[2].index("i")]
    out = math.prod(hlo_stats.arrays(inst.type)[0][1])
    n = rhs_shape[labels[2].index("o")]
    return _matmul_work(
        2.0 * out * features * taps,
        out // max(n, 1),
        n,
        features * taps,
        mxu_dim,
        _time_factor(operands, factors),
        share,
    )


def _kernel_work(
    inst: Instruction, mxu_dim: int, factors: dict[str, float], share: Share
) -> tuple[float, float]:
    flops = kernel_flops.kernel_flops(inst)
    spent = kernel_flops.splash_array_flops(inst, mxu_dim) or flops
    if kernel_flops.megablox_flops(inst) is not None:  # a grouped matmul: int8/fp8 operands?
        _, dtype = kernel_flops.matrix_operands(inst)
        spent *= factors.get(dtype, 1.0) if dtype else 1.0
    return flops, spent / share(flops) if flops else spent


def instruction_work(
    inst: Instruction,
    defs: dict[str, Instruction],
    mxu_dim: int,
    factors: dict[str, float] | None = None,
    share: Share = _full,
) -> tuple[float, float]:
    """factors: time per FLOP over bf16's by HLO element type (`Chip.mxu_time_factors`);
    share: the share of peak a matmul of so many FLOPs sustains (`sustained.matmul_share`)."""
    if inst.op == "dot":
        return _dot_work(inst, defs, mxu_dim, factors or {}, share)
    if inst.op == "convolution":
        return _conv_work(inst, defs, mxu_dim, factors or {}, share)
    if inst.op == "custom-call":
        return _kernel_work(inst, mxu_dim, factors or {}, share)
    return 0.0, 0.0


def computation_work(
    module: HloModule,
    name: str,
    memo: dict[str, tuple[float, float]],
    mxu_dim: int = 0,
    factors: dict[str, float] | None = None,
    share: Share = _full,
) -> tuple[float, float]:
    """(MXU FLOPs, the FLOPs as the array spends them, padding included) of one run of a
    fused (or called) computation, nested fusions included."""
    if name in memo:
        return memo[name]
    memo[name] = (0.0, 0.0)
    defs = module.defining(name)
    flops = spent = 0.0
    for inst in module.computations.get(name, []):
        work = [instruction_work(inst, defs, mxu_dim, factors, share)]
        if inst.op in ("fusion", "call"):
            work += [
                computation_work(module, c, memo, mxu_dim, factors, share)
                for kind, c in hlo_stats.called(inst)
                if kind == "calls"
            ]
        flops += sum(w[0] for w in work)
        spent += sum(w[1] for w in work)
    memo[name] = (flops, spent)
    return memo[name]
