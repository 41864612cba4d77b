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
  operands lose their batch dim (heads, seq, head_dim).
- XLA:TPU's grouped matmul (`ragged-dot-*`, what `jax.lax.ragged_dot` compiles to): lhs
  (rows, k) x rhs (groups, k, n), 2 x rows x k x n at its buffer's rows (the shape bound).
- the Pallas megablox grouped matmuls (models/qwen3/megablox.py), named `gmm`/`tgmm` in the
  compiled program and called from the computations megablox's jitted `gmm`/`tgmm` make in the
  lowered one: `gmm` (rows, k) x (groups, k, n) -> (rows, n) (or (groups, n, k): its backward's
  transposed weight), `tgmm`, the weight gradient, (rows, k), (rows, n) -> (groups, k, n);
  2 x rows x k x n at the buffer's rows, as `ragged-dot`.
"""

from __future__ import annotations

import json
import math
import re

from titan_jax.tools import hlo_stats
from titan_jax.tools.hlo_stats import Instruction

_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{(.*?)\}(?:, [a-z_]+=|$)")
_METADATA = re.compile(r'"xprof_metadata":"(\{.*?\})"')
_FLOAT = ("bf16", "f16", "f32")
_MEGABLOX = re.compile(r"(^|_)t?gmm[_.]")
_SPLASH_MATMULS = {"splash_mha_fwd": 2, "splash_mha_dkv": 4, "splash_mha_dq": 3}


def operand_shapes(inst: Instruction) -> list[tuple[str, tuple[int, ...]]]:
    """The operand (dtype, shape)s a custom call declares in its layout constraints."""
    found = _CONSTRAINTS.search(inst.rest)
    return hlo_stats.arrays(found[1]) if found else []


def causal_blocks(seq_q: int, seq_kv: int, block_q: int, block_kv: int) -> int:
    """(query block, key block) pairs holding at least one unmasked causal entry."""
    n_kv = math.ceil(seq_kv / block_kv)
    return sum(min(n_kv, ((i + 1) * block_q - 1) // block_kv + 1)
               for i in range(math.ceil(seq_q / block_q)))


def splash_flops(inst: Instruction, kind: str) -> float:
    shapes = [s if len(s) == 4 else (1, *s) for dtype, s in operand_shapes(inst)
              if dtype in _FLOAT and len(s) in (3, 4)]  # q, k first (the block tables are s8)
    if len(shapes) < 2:
        return 0.0
    (batch, heads, seq_q, head_dim), (_, _, seq_kv, _) = shapes[0], shapes[1]
    meta = _METADATA.search(inst.rest)
    blocks = json.loads(meta[1].replace('\\"', '"')) if meta else {}
    suffix = {"splash_mha_fwd": "", "splash_mha_dkv": "_dkv", "splash_mha_dq": "_dq"}[kind]
    block_q = blocks.get(f"block_q{suffix}", seq_q)
    block_kv = blocks.get(f"block_kv{suffix}", seq_kv)
    matmuls = _SPLASH_MATMULS[kind] + (kind == "splash_mha_dkv"
                                       and bool(blocks.get("use_fused_bwd_kernel")))
    if seq_kv > seq_q and seq_kv % seq_q == 0:  # one query shard of the whole causal mask
        pairs = causal_blocks(seq_kv, seq_kv, block_q, block_kv) / (seq_kv // seq_q)
    else:
        pairs = causal_blocks(seq_q, seq_kv, block_q, block_kv)
    return 2.0 * matmuls * batch * heads * head_dim * block_q * block_kv * pairs


def grouped_matmul_flops(inst: Instruction) -> float:
    shapes = [s for _, s in operand_shapes(inst) if len(s) >= 2]
    lhs = next((s for s in shapes if len(s) == 2), None)
    rhs = next((s for s in shapes if len(s) == 3), None)
    if lhs is None or rhs is None:
        return 0.0
    return 2.0 * lhs[0] * lhs[1] * rhs[2]


def megablox_flops(inst: Instruction, computation: str = "", hidden_split: int = 1
                   ) -> tuple[float, int] | None:
    """(FLOPs over its whole buffer, the buffer's rows) of a megablox grouped matmul, the
    instruction or its computation named for it (see the module docstring); None otherwise.
    `hidden_split`: the kernels run on one tp shard of the experts' hidden dim (their rows
    whole), so in the lowered module a call's FLOPs times that are its rows' work."""
    if inst.op != "custom-call" or not (_MEGABLOX.search(inst.name)
                                        or _MEGABLOX.search(computation)):
        return None
    operands = [s for dtype, s in operand_shapes(inst) if dtype in _FLOAT]
    out = hlo_stats.arrays(inst.type)
    if len(operands) != 2 or len(out) != 1:
        return None
    (lhs, rhs), out_shape = operands, out[0][1]
    if (len(lhs), len(rhs), len(out_shape)) == (2, 3, 2):  # gmm
        return hidden_split * 2.0 * lhs[0] * lhs[1] * out_shape[1], lhs[0]
    if (len(lhs), len(rhs), len(out_shape)) == (2, 2, 3):  # tgmm: (rows, k), (rows, n)
        return hidden_split * 2.0 * lhs[0] * lhs[1] * rhs[1], rhs[0]
    return None


def kernel_flops(inst: Instruction) -> float:
    """FLOPs of one run of a compiled custom call this module knows; 0 for any other."""
    if inst.op != "custom-call":
        return 0.0
    for kind in _SPLASH_MATMULS:
        if inst.name.startswith(kind):
            return splash_flops(inst, kind)
    if inst.name.startswith("ragged-dot") and "metadata" not in inst.name:
        return grouped_matmul_flops(inst)
    megablox = megablox_flops(inst)
    return megablox[0] if megablox else 0.0
