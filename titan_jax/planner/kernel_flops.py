"""MXU FLOPs of the Pallas/Mosaic kernels of a compiled TPU program, from their shapes.

XLA's FLOP counts skip custom calls. Two kernel families run titan-jax's heavy matmuls on TPU:
- splash attention (`splash_mha_fwd*`, `splash_mha_dkv*`, `splash_mha_dq*`, as the compiled
  program names them): per (query block, key block) pair the kernel computes, 2 x block_q x
  block_kv x head_dim FLOPs per matmul and head; the forward runs 2 matmuls (q k^T, p v), the
  dK/dV kernel 4 (q k^T again, dO v^T, p^T dO, dS^T q; 5 with dQ fused), the dQ kernel 3. The
  pairs are those a causal mask leaves unmasked (titan-jax's only splash mask), from the block
  sizes the kernel records in its metadata. Under context parallelism a call computes one
  query shard (T / 2cp rows) of the whole (T x T) mask, which one it is traced: it is counted
  at the mask's mean share per shard, exact for a rank's load-balanced pair (chunks i and
  2cp-1-i together hold 2 / 2cp of the mask's blocks). With one example per device the
  operands lose their batch dim (heads, seq, head_dim). Their HBM reads follow the kernels'
  grids (`splash_read_factors`: one side of the attention is re-read per block pair), and
  their matmuls over the head dim fill only head_dim of the MXU's depth
  (`splash_array_flops`).
- XLA:TPU's grouped matmul (`ragged-dot-*`, what `jax.lax.ragged_dot` compiles to): lhs
  (rows, k) x rhs (groups, k, n), 2 x rows x k x n at its buffer's rows (the shape bound).
- the Pallas megablox grouped matmuls (models/qwen3/megablox.py), named `gmm`/`tgmm` in the
  compiled program and called from the computations megablox's jitted `gmm`/`tgmm` make in the
  lowered one: `gmm` (rows, k) x (groups, k, n) -> (rows, n) (or (groups, n, k): its backward's
  transposed weight), `tgmm`, the weight gradient, (rows, k), (rows, n) -> (groups, k, n);
  2 x rows x k x n at the buffer's rows, as `ragged-dot`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from titan_jax.planner import hlo_stats
from titan_jax.planner.hlo_stats import Instruction

_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{(.*?)\}(?:, [a-z_]+=|$)")
_METADATA = re.compile(r'"xprof_metadata":"(\{.*?\})"')
_FLOAT = ("bf16", "f16", "f32")
_LOW_PRECISION = ("s8", "f8e4m3fn", "f8e5m2")
_MEGABLOX = re.compile(r"(^|_)t?gmm[_.]")
_SPLASH_MATMULS = {"splash_mha_fwd": 2, "splash_mha_dkv": 4, "splash_mha_dq": 3}
_SEQ_MINOR = 2  # splash's QKVLayout.SEQ_MINOR: q or k stored (batch, heads, head_dim, seq)


def operand_shapes(inst: Instruction) -> list[tuple[str, tuple[int, ...]]]:
    """The operand (dtype, shape)s a custom call declares in its layout constraints."""
    found = _CONSTRAINTS.search(inst.rest)
    return hlo_stats.arrays(found[1]) if found else []


def matrix_operands(inst: Instruction) -> tuple[list[tuple[int, ...]], str | None]:
    """The shapes of a grouped-matmul kernel's two matrices, and their element type when it
    is a low-precision one. A quantized kernel (tokamax's, `[quantize]`) takes int8/fp8 values
    and each one's float scales, broadcast to tiles as large as the values: the values are
    the matrices."""
    shapes = operand_shapes(inst)
    low = [(dtype, s) for dtype, s in shapes if dtype in _LOW_PRECISION]
    if low:
        return [s for _, s in low], low[0][0]
    return [s for dtype, s in shapes if dtype in _FLOAT], None


def causal_blocks(seq_q: int, seq_kv: int, block_q: int, block_kv: int) -> int:
    """(query block, key block) pairs holding at least one unmasked causal entry."""
    n_kv = math.ceil(seq_kv / block_kv)
    return sum(
        min(n_kv, ((i + 1) * block_q - 1) // block_kv + 1)
        for i in range(math.ceil(seq_q / block_q))
    )


@dataclasses.dataclass(frozen=True)
class _Splash:
    """One splash call's shapes: batch, query heads, kv heads, query rows, key rows, head
    dim, its kernel's block sizes, the (query block, key block) pairs it computes, matmuls
    per pair and how many of them contract over the head dim (q k^T, dO v^T)."""

    kind: str
    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    block_q: int
    block_kv: int
    pairs: float
    matmuls: int
    head_dim_matmuls: int


def _splash(inst: Instruction) -> _Splash | None:
    kind = next((k for k in _SPLASH_MATMULS if inst.name.startswith(k)), None)
    operands = operand_shapes(inst)
    shapes = [
        s if len(s) == 4 else (1, *s)
        for dtype, s in operands
        if dtype in _FLOAT and len(s) in (3, 4)
    ]  # q, k first (the block tables are s8)
    if kind is None or inst.op != "custom-call" or len(shapes) < 2:
        return None
    meta = _METADATA.search(inst.rest)
    blocks = json.loads(meta[1].replace('\\"', '"')) if meta else {}
    # q and k as (batch, heads, seq, head_dim), whichever layout the kernel takes them in.
    q, k = (
        shape[:2] + shape[:1:-1] if blocks.get(f"{side}_layout") == _SEQ_MINOR else shape
        for side, shape in zip("qk", shapes[:2], strict=True)
    )
    (batch, heads, seq_q, head_dim), (_, kv_heads, seq_kv, _) = q, k
    suffix = {"splash_mha_fwd": "", "splash_mha_dkv": "_dkv", "splash_mha_dq": "_dq"}[kind]
    block_q = blocks.get(f"block_q{suffix}") or seq_q
    block_kv = blocks.get(f"block_kv{suffix}") or seq_kv
    # A dK/dV kernel that also computes dQ returns it beside dK and dV (tokamax's splash records
    # no flag for it in the dK/dV kernel's metadata).
    fused_dq = kind == "splash_mha_dkv" and (
        bool(blocks.get("use_fused_bwd_kernel")) or len(hlo_stats.arrays(inst.type)) > 2
    )
    if seq_kv > seq_q and seq_kv % seq_q == 0:  # one query shard of the whole causal mask
        pairs = causal_blocks(seq_kv, seq_kv, block_q, block_kv) / (seq_kv // seq_q)
    else:
        pairs = causal_blocks(seq_q, seq_kv, block_q, block_kv)
    # A kernel given its mask's blocks as a list (1-D s8 tables: tokamax's splash) visits at
    # most that many pairs: fewer than causal for a local (sliding-window) mask. (s8 only: a
    # 1-D s32 operand may be one example's segment ids, a row per token.)
    listed = [shape[0] for dtype, shape in operands if dtype == "s8" and len(shape) == 1]
    pairs = min(pairs, max(listed)) if listed else pairs
    return _Splash(
        kind,
        batch,
        heads,
        kv_heads,
        seq_q,
        seq_kv,
        head_dim,
        block_q,
        block_kv,
        pairs,
        _SPLASH_MATMULS[kind] + fused_dq,
        1 if kind == "splash_mha_fwd" else 2,
    )


def splash_flops(inst: Instruction) -> float:
    s = _splash(inst)
    if s is None:
        return 0.0
    return 2.0 * s.matmuls * s.batch * s.heads * s.head_dim * s.block_q * s.block_kv * s.pairs


def splash_read_factors(inst: Instruction) -> list[float] | None:
    """How many times a splash call reads each of its operands from HBM (None: not splash).
    The kernels stream one operand side per (query block, key block) pair and read the other
    once per block row: the forward and dQ kernels (grid heads x query blocks x key blocks)
    re-read k and v for every pair and every query head of a kv group, the dK/dV kernel (grid
    heads x key blocks x query blocks) reads k, v once per query head and re-reads q, dO and
    the softmax statistics for every pair. Operands: the block tables, q, k, v, then the
    query side (statistics, dO)."""
    s = _splash(inst)
    if s is None:
        return None
    group = s.heads / s.kv_heads
    kv_streamed = group * s.pairs / math.ceil(s.seq_kv / s.block_kv)
    q_streamed = s.pairs / math.ceil(s.seq_q / s.block_q)
    dkv = s.kind == "splash_mha_dkv"
    factors, position = [], 0
    for dtype, shape in operand_shapes(inst):
        if dtype not in _FLOAT or len(shape) not in (3, 4):
            factors.append(1.0)
            continue
        kv_side = position in (1, 2)
        factors.append((group if dkv else kv_streamed) if kv_side else (q_streamed if dkv else 1.0))
        position += 1
    return factors


def array_efficiency(size: int, mxu_dim: int) -> float:
    """The share of an MXU dimension a matmul dimension of `size` fills (padded up to whole
    multiples of the systolic array's side); 1 when the array size is not known."""
    if mxu_dim <= 0 or size <= 0:
        return 1.0
    return size / (math.ceil(size / mxu_dim) * mxu_dim)


def splash_array_flops(inst: Instruction, mxu_dim: int) -> float:
    """A splash call's FLOPs as the MXU spends them: its matmuls that contract over the head
    dim (q k^T, dO v^T) fill head_dim / mxu_dim of the array's depth (half of v6e's 256 at
    head_dim 128); the others contract over a block (full)."""
    s = _splash(inst)
    if s is None:
        return 0.0
    per_matmul = splash_flops(inst) / s.matmuls
    contracting = array_efficiency(s.head_dim, mxu_dim)
    return per_matmul * (s.head_dim_matmuls / contracting + s.matmuls - s.head_dim_matmuls)


def grouped_matmul_flops(inst: Instruction) -> float:
    shapes = [s for _, s in operand_shapes(inst) if len(s) >= 2]
    lhs = next((s for s in shapes if len(s) == 2), None)
    rhs = next((s for s in shapes if len(s) == 3), None)
    if lhs is None or rhs is None:
        return 0.0
    return 2.0 * lhs[0] * lhs[1] * rhs[2]


def megablox_flops(
    inst: Instruction, computation: str = "", hidden_split: int = 1
) -> tuple[float, int] | None:
    """(FLOPs over its whole buffer, the buffer's rows) of a megablox grouped matmul, the
    instruction or its computation named for it (see the module docstring); None otherwise.
    `hidden_split`: the kernels run on one tp shard of the experts' hidden dim (their rows
    whole), so in the lowered module a call's FLOPs times that are its rows' work."""
    if inst.op != "custom-call" or not (
        _MEGABLOX.search(inst.name) or _MEGABLOX.search(computation)
    ):
        return None
    operands, _ = matrix_operands(inst)
    out = hlo_stats.arrays(inst.type)
    if len(operands) != 2 or len(out) != 1:
        return None
    (lhs, rhs), out_shape = operands, out[0][1]
    if (len(lhs), len(rhs), len(out_shape)) == (2, 3, 2):  # gmm
        return hidden_split * 2.0 * lhs[0] * lhs[1] * out_shape[1], lhs[0]
    if (len(lhs), len(rhs), len(out_shape)) == (2, 2, 3):  # tgmm: (rows, k), (rows, n)
        return hidden_split * 2.0 * lhs[0] * lhs[1] * rhs[1], rhs[0]
    return None


def grouped_rows(inst: Instruction) -> int | None:
    """The rows of a grouped matmul's buffer (`ragged-dot`, megablox/tokamax `gmm`, `tgmm`):
    the ragged dimension its groups are cut from; None for any other instruction."""
    if inst.op != "custom-call":
        return None
    if inst.name.startswith("ragged-dot") and "metadata" not in inst.name:
        lhs = next((s for _, s in operand_shapes(inst) if len(s) == 2), None)
        return lhs[0] if lhs else None
    megablox = megablox_flops(inst)
    return megablox[1] if megablox else None


def kernel_flops(inst: Instruction) -> float:
    """FLOPs of one run of a compiled custom call this module knows; 0 for any other."""
    if inst.op != "custom-call":
        return 0.0
    if any(inst.name.startswith(kind) for kind in _SPLASH_MATMULS):
        return splash_flops(inst)
    if inst.name.startswith("ragged-dot") and "metadata" not in inst.name:
        return grouped_matmul_flops(inst)
    megablox = megablox_flops(inst)
    return megablox[0] if megablox else 0.0
