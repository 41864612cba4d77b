"""HLO text read as the planner reads it (planner/hlo_stats.py): instructions, array types,
loop trip counts, executions per step, matmul FLOPs and collectives."""

from __future__ import annotations

from titan_jax.planner import hlo_stats

# A scan of 3 iterations whose body holds a loop of 4: dots run 1, 3 and 12 times.
LOOPS = """
HloModule m

%inner_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,16]{1,0} constant({...})
  %d3 = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag = bf16[64,16]{1,0} all-gather(%x), replica_groups=[2,4]<=[8], dimensions={0}
}

%inner_cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,32]{1,0} constant({...})
  %d2 = f32[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %loop = (s32[], f32[8,16]{1,0}) while(%p), condition=%inner_cond, body=%inner_body
}

%outer_cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} constant({...})
  %d1 = f32[8,4]{1,0} dot(f32[8,16]{1,0} %a, f32[16,4]{1,0} %b), lhs_contracting_dims={1}
  %t = (s32[], f32[8,16]{1,0}) tuple(%i0, %a)
  %loop = (s32[], f32[8,16]{1,0}) while(%t), condition=%outer_cond, body=%outer_body
  %ar = f32[8,16]{1,0} all-reduce(%a), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}
"""


def test_flops_count_every_loop_iteration():
    module = hlo_stats.parse(LOOPS)
    counts, unknown = hlo_stats.executions(module)
    assert (counts["main"], counts["outer_body"], counts["inner_body"], unknown) == (1, 3, 12, 0)
    flops, _ = hlo_stats.dot_flops(module)
    assert flops == 2 * (8 * 4 * 16 + 3 * 8 * 32 * 16 + 12 * 8 * 16 * 16)


def test_collectives_carry_groups_and_executions():
    ops = {c["op"]: c for c in hlo_stats.collective_ops(hlo_stats.parse(LOOPS))}
    assert ops["all-gather"]["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ops["all-gather"]["executions"] == 12 and ops["all-gather"]["bytes"] == 64 * 16 * 2
    assert ops["all-reduce"]["groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    iota = hlo_stats.Instruction(
        "x", "f32[4]", "all-gather", "%a), replica_groups=[4,2]<=[2,4]T(1,0)"
    )
    assert hlo_stats.replica_groups(iota) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_array_types_and_their_bytes():
    assert hlo_stats.arrays("(f32[8,16]{1,0}, bf16[4]{0}, f8e4m3fn[2,2]{1,0})") == [
        ("f32", (8, 16)),
        ("bf16", (4,)),
        ("f8e4m3fn", (2, 2)),
    ]
    assert hlo_stats.nbytes("bf16", (4, 8)) == 64
    assert hlo_stats.nbytes("f32", ()) == 4
    assert hlo_stats.nbytes("s8", (3, 5)) == 15


def test_operands_are_named_past_types_and_nested_attributes():
    inst = hlo_stats.Instruction(
        "d", "f32[8,4]{1,0}", "dot", "f32[8,16]{1,0} %a, f32[16,4]{1,0} %b), dims={1}"
    )
    assert inst.operands == ["a", "b"]
    module = hlo_stats.parse(LOOPS)
    assert module.entry == "main"
    assert [i.op for i in module.computations["inner_body"]] == [
        "parameter",
        "get-tuple-element",
        "constant",
        "dot",
        "all-gather",
    ]
