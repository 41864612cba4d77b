"""The work of the Pallas kernels XLA's FLOP count skips, from their shapes
(planner/kernel_flops.py): causal block counts, the MXU's fill, megablox's grouped matmuls."""

from __future__ import annotations

import pytest

from titan_jax.planner import kernel_flops
from titan_jax.planner.hlo_stats import Instruction


def _custom_call(name: str, out: str, operands: str) -> Instruction:
    return Instruction(
        name,
        out,
        "custom-call",
        f'%a, %b, %g), custom_call_target="tpu_custom_call", '
        f"operand_layout_constraints={{{operands}}}",
    )


def test_causal_blocks_count_the_pairs_with_an_unmasked_entry():
    assert kernel_flops.causal_blocks(4, 4, 1, 1) == 10  # the lower triangle with its diagonal
    assert kernel_flops.causal_blocks(512, 512, 128, 128) == 10
    assert kernel_flops.causal_blocks(512, 512, 256, 128) == 2 + 4
    assert kernel_flops.causal_blocks(512, 512, 512, 512) == 1


def test_a_matmul_dimension_fills_whole_multiples_of_the_array():
    assert kernel_flops.array_efficiency(128, 256) == 0.5
    assert kernel_flops.array_efficiency(300, 128) == pytest.approx(300 / 384)
    assert kernel_flops.array_efficiency(512, 128) == 1.0
    assert kernel_flops.array_efficiency(100, 0) == 1.0  # array size unknown: not priced


def test_megablox_gmm_and_tgmm_count_their_whole_buffer():
    rows, k, n, experts = 64, 32, 16, 4
    rows_k, rows_n = f"bf16[{rows},{k}]{{1,0}}", f"bf16[{rows},{n}]{{1,0}}"
    weights, sizes = f"bf16[{experts},{k},{n}]{{2,1,0}}", f"s32[{experts}]{{0}}"
    gmm = _custom_call("gmm.3", rows_n, f"{rows_k}, {weights}, {sizes}")
    assert kernel_flops.megablox_flops(gmm) == (2.0 * rows * k * n, rows)
    assert kernel_flops.megablox_flops(gmm, hidden_split=4) == (4 * 2.0 * rows * k * n, rows)
    assert kernel_flops.kernel_flops(gmm) == 2.0 * rows * k * n
    assert kernel_flops.grouped_rows(gmm) == rows
    tgmm = _custom_call("tgmm.1", weights, f"{rows_k}, {rows_n}, {sizes}")
    assert kernel_flops.megablox_flops(tgmm) == (2.0 * rows * k * n, rows)
    # quantized operands (tokamax's int8 kernel): the values are the matrices
    values = f"s8[{rows},{k}]{{1,0}}, f32[{rows},{k}]{{1,0}}"
    weight_values = f"s8[{experts},{k},{n}]{{2,1,0}}, f32[{experts},{k},{n}]{{2,1,0}}"
    q = _custom_call("gmm.7", rows_n, f"{values}, {weight_values}")
    assert kernel_flops.matrix_operands(q) == ([(rows, k), (experts, k, n)], "s8")
    assert kernel_flops.megablox_flops(q) == (2.0 * rows * k * n, rows)


def test_other_instructions_are_no_kernel_work():
    dot = Instruction("d", "f32[8,4]{1,0}", "dot", "%a, %b), lhs_contracting_dims={1}")
    assert kernel_flops.kernel_flops(dot) == 0.0 and kernel_flops.grouped_rows(dot) is None
    unknown = _custom_call("my_kernel.1", "f32[8]{0}", "f32[8]{0}")
    assert kernel_flops.kernel_flops(unknown) == 0.0
    assert kernel_flops.megablox_flops(unknown) is None
