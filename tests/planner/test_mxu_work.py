# ruff: noqa: E501 (HLO text keeps its lines whole)
"""The MXU work of compiled instructions (planner/mxu_work.py): FLOPs, and the FLOPs as the
systolic array spends them (padding to the array's side, low-precision rates, sustained share)."""

from __future__ import annotations

import pytest

from titan_jax.planner import hlo_stats, mxu_work

MODULE = """
%fused (p0: s8[100,128], p1: s8[128,300]) -> s32[100,300] {
  %p0 = s8[100,128]{1,0} parameter(0)
  %p1 = s8[128,300]{1,0} parameter(1)
  ROOT %q = s32[100,300]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[100,128], b: bf16[128,300], c: s8[100,128], d: s8[128,300]) -> bf16[100,300] {
  %a = bf16[100,128]{1,0} parameter(0)
  %b = bf16[128,300]{1,0} parameter(1)
  %c = s8[100,128]{1,0} parameter(2)
  %d = s8[128,300]{1,0} parameter(3)
  %m = bf16[100,300]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %f = s32[100,300]{1,0} fusion(%c, %d), kind=kOutput, calls=%fused
  ROOT %e = bf16[100,300]{1,0} add(%m, %m)
}
"""
FLOPS = 2.0 * 100 * 300 * 128
# k = 128 fills a 128-deep array; the better-filling free dim is 300 of 384
FILL = 300 / 384


def test_a_dot_is_spent_at_the_share_of_the_array_it_fills():
    module = hlo_stats.parse(MODULE)
    defs = module.defining("main")
    flops, spent = mxu_work.instruction_work(defs["m"], defs, 128)
    assert flops == FLOPS and spent == pytest.approx(FLOPS / FILL)
    assert mxu_work.instruction_work(defs["m"], defs, 0) == (FLOPS, FLOPS)  # array not known
    half_share = mxu_work.instruction_work(defs["m"], defs, 128, share=lambda f: 0.5)
    assert half_share[1] == pytest.approx(2 * FLOPS / FILL)
    assert mxu_work.instruction_work(defs["e"], defs, 128) == (0.0, 0.0)  # not a matmul


def test_a_fusion_counts_its_nested_dots_at_their_operands_rate():
    module = hlo_stats.parse(MODULE)
    int8_twice_as_fast = {"s8": 0.5}
    flops, spent = mxu_work.computation_work(module, "fused", {}, 128, int8_twice_as_fast)
    assert flops == FLOPS and spent == pytest.approx(0.5 * FLOPS / FILL)
    flops, spent = mxu_work.computation_work(module, "main", {}, 128, int8_twice_as_fast)
    assert flops == 2 * FLOPS and spent == pytest.approx(1.5 * FLOPS / FILL)
