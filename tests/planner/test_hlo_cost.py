# ruff: noqa: E501 (HLO text keeps its lines whole)
"""The compiled-program cost model (planner/hlo_cost.py), kernel FLOPs (planner/kernel_flops.py),
grouped-matmul FLOPs (planner/hlo_stats.py) and `fits` on both sides of XLA:TPU's memory edge."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from titan_jax.planner import aot_compile, hlo_cost, hlo_stats, kernel_flops, mxu_work
from titan_jax.planner.topology import CHIPS, Chip, parse_slice

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
)

# 1 TFLOP/s, 1 GB/s HBM, 1 GB/s ICI per ring: seconds read as TFLOPs / GB.
UNIT_CHIP = Chip("test", 1e12, 2**40, 1e9, 2e9, 1e9, 1, "test")  # 2 ports: a ring gets 1 GB/s

# A scheduled program: a 2 GB all-gather started before a fusion whose dot is 3 TFLOPs (3 s at
# the test chip's peak) and done after it; then a synchronous all-reduce of 1 GB over 2 devices.
SCHEDULE = """
HloModule m, is_scheduled=true

%fused_dot (p0: bf16[1000,1000], p1: bf16[1000,1500000]) -> bf16[1000,1500000] {
  %p0 = bf16[1000,1000]{1,0} parameter(0)
  %p1 = bf16[1000,1500000]{1,0} parameter(1)
  ROOT %d = bf16[1000,1500000]{1,0:S(1)} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[1000,1000], b: bf16[1000,1500000], w: bf16[500000000]) -> f32[250000000] {
  %a = bf16[1000,1000]{1,0:S(1)} parameter(0)
  %b = bf16[1000,1500000]{1,0:S(1)} parameter(1)
  %w = bf16[500000000]{0} parameter(2)
  %ags = (bf16[500000000]{0}, bf16[1000000000]{0}) all-gather-start(%w), replica_groups=mesh['x'=2,'y'=4] {'x'}, dimensions={0}
  %f = bf16[1000,1500000]{1,0:S(1)} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  %agd = bf16[1000000000]{0} all-gather-done(%ags)
  %c = f32[250000000]{0} convert(%agd)
  %ar = f32[250000000]{0} all-reduce(%c), replica_groups={{0,1},{2,3}}, to_apply=%add
}
"""


def test_schedule_costs_each_op_by_its_slower_unit_and_exposes_what_compute_does_not_cover():
    r = hlo_cost.estimate(SCHEDULE, UNIT_CHIP, 8)
    found = {c["op"]: c for c in r["collectives"]}
    gather, reduce = found["all-gather"], found["all-reduce"]
    # all-gather over 'x' (2 devices): 1 GB of the 2 GB result arrives over ICI: 1 s, under
    # the 3 s dot.
    assert gather["group"] == 2 and gather["seconds"] == pytest.approx(1.0)
    assert gather["covered_s"] == pytest.approx(3.0) and gather["overlap"] == 1.0
    # all-reduce of 1 GB over 2: a ring moves 2 x 1 GB x 1/2 = 1 GB: 1 s, all exposed.
    assert reduce["seconds"] == pytest.approx(1.0) and reduce["overlap"] == 0.0
    # The convert reads 2 GB and writes 1 GB of HBM (3 s); the dot's operands and result
    # are in VMEM (S(1)), so it costs its FLOPs.
    assert r["compute_s"] == pytest.approx(3.0 + 3.0)
    assert r["exposed_collective_s"] == pytest.approx(1.0)
    assert r["step_s"] == pytest.approx(7.0)


def test_group_size_reads_the_mesh_form_of_replica_groups():
    inst = hlo_stats.parse(SCHEDULE).defining("main")["ags"]
    assert hlo_stats.group_size(inst, 8) == 2
    plain = hlo_stats.Instruction("x", "f32[4]", "all-reduce", "%a), replica_groups={{0,1,2}}")
    assert hlo_stats.group_size(plain, 8) == 3


# One layer of a (36, 1000) stacked buffer sliced by a fusion: directly, or (as XLA:TPU does
# with a scan's saved layer inputs, 94 layers deep on 235B) by an inner fusion it hands the
# whole stack to.
SLICE = """
%fused (p0: f32[36,1000], p1: s32[]) -> f32[1,1000] {
  %p0 = f32[36,1000]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1000]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,1000}
}
"""
NESTING = """
%outer (p0: f32[36,1000], p1: s32[]) -> f32[1,1000] {
  %p0 = f32[36,1000]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %in = f32[1,1000]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused
  ROOT %neg = f32[1,1000]{1,0} negate(%in)
}
"""


@pytest.mark.parametrize("nested", [False, True])
def test_a_fused_dynamic_slice_reads_only_the_slice(nested):
    text = (
        SLICE
        + (NESTING if nested else "")
        + f"""
ENTRY %main (w: f32[36,1000], i: s32[]) -> f32[1,1000] {{
  %w = f32[36,1000]{{1,0}} parameter(0)
  %i = s32[]{{:S(2)}} parameter(1)
  ROOT %f = f32[1,1000]{{1,0}} fusion(%w, %i), kind=kLoop, calls=%{"outer" if nested else "fused"}
}}
"""
    )
    module = hlo_stats.parse(text)
    fusion = module.defining("main")["f"]
    assert hlo_cost.traffic(module, fusion, module.defining("main")) == 2 * 4000


def test_an_allocated_buffer_moves_no_bytes():
    """XLA:TPU's `AllocateBuffer` (an uninitialised buffer a loop then fills) reserves memory
    only; the copy beside it reads and writes its 2 GB."""
    module = """
HloModule m, is_scheduled=true

ENTRY %main (x: bf16[31,16384,2048]) -> (bf16[31,16384,2048], bf16[31,16384,2048]) {
  %x = bf16[31,16384,2048]{2,1,0} parameter(0)
  %a = bf16[31,16384,2048]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  %c = bf16[31,16384,2048]{2,1,0} copy(%x)
  ROOT %t = (bf16[31,16384,2048]{2,1,0}, bf16[31,16384,2048]{2,1,0}) tuple(%a, %c)
}
"""
    r = hlo_cost.estimate(module, UNIT_CHIP, 1)
    assert r["hbm_bytes_per_chip"] == 2 * 31 * 16384 * 2048 * 2


# A loop body's in-place update of a 4 GB buffer with a 1 GB slice, and a 3 GB prefetch into
# VMEM (S(1)) started before a 2 TFLOP dot (2 s) whose operands are already on chip.
IN_PLACE_AND_PREFETCH = """
HloModule m, is_scheduled=true

ENTRY %main (buf: f32[4,250000000], up: f32[1,250000000], i: s32[], w: bf16[1500000000], a: bf16[1000,1000], b: bf16[1000,1000000]) -> bf16[1000,1000000] {
  %buf = f32[4,250000000]{1,0} parameter(0)
  %up = f32[1,250000000]{1,0:S(1)} parameter(1)
  %i = s32[]{:S(2)} parameter(2)
  %w = bf16[1500000000]{0} parameter(3)
  %a = bf16[1000,1000]{1,0:S(1)} parameter(4)
  %b = bf16[1000,1000000]{1,0:S(1)} parameter(5)
  %dus = f32[4,250000000]{1,0} dynamic-update-slice(%buf, %up, %i, %i)
  %cs = (bf16[1500000000]{0:S(1)}, bf16[1500000000]{0}, u32[]{:S(2)}) copy-start(%w)
  %d = bf16[1000,1000000]{1,0:S(1)} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %cd = bf16[1500000000]{0:S(1)} copy-done(%cs)
}
"""


def test_an_in_place_update_moves_its_slice_and_a_prefetch_shares_hbm_with_its_window():
    r = hlo_cost.estimate(IN_PLACE_AND_PREFETCH, UNIT_CHIP, 1)
    # The update: 1 GB from VMEM written into HBM in place (1 s), not the 4 GB buffer read and
    # written; the prefetch's 3 GB of HBM reads (3 s) outlast the 2 s dot it runs under: 1 s.
    assert r["hbm_bytes_per_chip"] == pytest.approx(1e9 + 3e9)
    assert r["dma_wait_s"] == pytest.approx(3.0 - 2.0)
    assert r["step_s"] == pytest.approx(1.0 + 2.0 + 1.0)


RAGGED = """
HloModule m

ENTRY %main (x: bf16[96,64], w: bf16[8,64,32], g: s32[8], dy: bf16[96,32]) -> bf16[8,64,32] {
  %x = bf16[96,64]{1,0} parameter(0)
  %w = bf16[8,64,32]{2,1,0} parameter(1)
  %g = s32[8]{0} parameter(2)
  %dy = bf16[96,32]{1,0} parameter(3)
  %y = bf16[96,32]{1,0} ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}
  ROOT %dw = bf16[8,64,32]{2,1,0} ragged-dot(%x, %dy, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}, lhs_ragged_dims={0}
}
"""


def test_grouped_matmuls_count_their_rows_and_scale_to_balanced_routing():
    module = hlo_stats.parse(RAGGED)
    per_op = 2 * 96 * 64 * 32  # each of the 96 rows times one group's 64 x 32 weight
    assert hlo_stats.ragged_dot_flops(module) == (2 * per_op, 2 * per_op)
    # 24 picks fill a buffer of 96 rows (say, a worst-case EP receive buffer): a quarter.
    assert hlo_stats.ragged_dot_flops(module, expected_rows=24) == (per_op / 2, 2 * per_op)
    assert hlo_stats.dot_flops(module)[0] == 0  # not dots


# A conditional whose one branch runs a grouped matmul and whose other runs none (the expert
# FFN's taken-branch VJP: the fallback recomputes, the fast path only exchanges rows).
ONE_BRANCH_GROUPED = """
HloModule m

%grouped (p: (bf16[96,64], bf16[8,64,32], s32[8])) -> bf16[96,32] {
  %p = (bf16[96,64]{1,0}, bf16[8,64,32]{2,1,0}, s32[8]{0}) parameter(0)
  %x = bf16[96,64]{1,0} get-tuple-element(%p), index=0
  %w = bf16[8,64,32]{2,1,0} get-tuple-element(%p), index=1
  %g = s32[8]{0} get-tuple-element(%p), index=2
  ROOT %y = bf16[96,32]{1,0} ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}
}

%none (p: (bf16[96,64], bf16[8,64,32], s32[8])) -> bf16[96,32] {
  %p = (bf16[96,64]{1,0}, bf16[8,64,32]{2,1,0}, s32[8]{0}) parameter(0)
  ROOT %z = bf16[96,32]{1,0} broadcast(bf16[] constant(0)), dimensions={}
}

ENTRY %main (c: pred[], x: bf16[96,64], w: bf16[8,64,32], g: s32[8]) -> bf16[96,32] {
  %c = pred[] parameter(0)
  %x = bf16[96,64]{1,0} parameter(1)
  %w = bf16[8,64,32]{2,1,0} parameter(2)
  %g = s32[8]{0} parameter(3)
  %t = (bf16[96,64]{1,0}, bf16[8,64,32]{2,1,0}, s32[8]{0}) tuple(%x, %w, %g)
  ROOT %r = bf16[96,32]{1,0} conditional(%c, %t, %t), true_computation=%none, false_computation=%grouped
}
"""


def test_grouped_matmul_flops_count_the_expected_branch_else_the_cheaper_one():
    """At balanced routing a conditional counts the branch traced under EXPECTED_BRANCH (the
    fast path) or the sibling of one traced under RARE_BRANCH, else its cheaper one; a branch
    without grouped matmuls counts 0."""
    per_op = 2 * 96 * 64 * 32
    unmarked = hlo_stats.parse(ONE_BRANCH_GROUPED)
    assert hlo_stats.ragged_dot_flops(unmarked, expected_rows=24) == (0.0, per_op)
    marked = hlo_stats.parse(
        ONE_BRANCH_GROUPED.replace(
            "rhs_group_dims={0}\n}",
            'rhs_group_dims={0}, metadata={op_name="jit(step)/cond/'
            'branch_1_fun/expected_branch/ragged_dot"}\n}',
        )
    )
    assert hlo_stats.ragged_dot_flops(marked, expected_rows=24) == (per_op / 4, per_op)
    rare = hlo_stats.parse(
        ONE_BRANCH_GROUPED.replace(
            "rhs_group_dims={0}\n}",
            'rhs_group_dims={0}, metadata={op_name="jit(step)/cond/'
            'branch_1_fun/rare_branch/ragged_dot"}\n}',
        )
    )
    assert hlo_stats.ragged_dot_flops(rare, expected_rows=24) == (0.0, per_op)


SPLASH = (
    "  %splash_mha_fwd_residuals.3 = (f32[2,512,128]{2,1,0}, bf16[2,16,512,128]{3,2,1,0}) "
    'custom-call(%a, %b, %q, %k, %v, %i), custom_call_target="tpu_custom_call", '
    "operand_layout_constraints={s8[1,1,1]{2,1,0}, s8[1,1,1]{2,1,0}, "
    "bf16[2,16,512,128]{3,2,1,0}, bf16[2,8,512,128]{3,2,1,0}, bf16[2,8,512,128]{3,2,1,0}, "
    "s32[512,128]{1,0}}, frontend_attributes={kernel_metadata={\n"
    '"xprof_metadata":"{\\"block_q\\": 256, \\"block_kv\\": 256, \\"block_q_dkv\\": 256, '
    '\\"block_kv_dkv\\": 256, \\"block_q_dq\\": 128, \\"block_kv_dq\\": 128, '
    '\\"use_fused_bwd_kernel\\": false}"\n}}, backend_config={}\n'
)


def test_splash_kernels_count_the_causal_blocks_they_compute():
    module = hlo_stats.parse("ENTRY %main () -> f32[] {\n" + SPLASH + "}\n")
    (inst,) = module.computations["main"]
    assert kernel_flops.causal_blocks(512, 512, 256, 256) == 3  # of 4: one block is masked
    assert kernel_flops.causal_blocks(512, 512, 128, 128) == 10
    per_pair = 2 * 2 * 16 * 128 * 256 * 256  # batch 2, 16 heads, head_dim 128
    assert kernel_flops.kernel_flops(inst) == 2 * 3 * per_pair  # q k^T and p v
    dq = hlo_stats.Instruction("splash_mha_dq_no_residuals.1", inst.type, inst.op, inst.rest)
    assert kernel_flops.kernel_flops(dq) == 3 * 10 * per_pair / 4  # 128-blocks: a quarter each
    other = hlo_stats.Instruction("my_kernel.1", inst.type, inst.op, inst.rest)
    assert kernel_flops.kernel_flops(other) == 0


def test_splash_under_cp_counts_its_query_shards_share_of_the_causal_mask():
    """One rank's chunk (256 of 1024 queries, one example: no batch dim) against the whole
    sequence's keys: a quarter of the whole causal mask's blocks."""
    line = SPLASH.replace(
        "bf16[2,16,512,128]{3,2,1,0}, bf16[2,8,512,128]{3,2,1,0}, bf16[2,8,512,128]{3,2,1,0}",
        "bf16[16,256,128]{2,1,0}, bf16[8,1024,128]{2,1,0}, bf16[8,1024,128]{2,1,0}",
    )
    module = hlo_stats.parse("ENTRY %main () -> f32[] {\n" + line + "}\n")
    (inst,) = module.computations["main"]
    per_pair = 2 * 16 * 128 * 256 * 256
    whole_mask = kernel_flops.causal_blocks(1024, 1024, 256, 256)  # 10 of 16
    assert kernel_flops.kernel_flops(inst) == 2 * per_pair * whole_mask / 4


def test_tokamax_splash_in_seq_minor_layouts_with_listed_blocks():
    """tokamax's splash (MaxText's) takes q and k as (batch, heads, head_dim, seq), lists its
    mask's blocks (1-D tables: fewer than causal under a local mask) and fuses dQ into the
    dK/dV kernel, which then returns three arrays."""
    line = SPLASH.replace(
        "bf16[2,16,512,128]{3,2,1,0}, bf16[2,8,512,128]{3,2,1,0}, bf16[2,8,512,128]{3,2,1,0}",
        "bf16[2,16,128,512]{3,2,1,0}, bf16[2,8,128,512]{3,2,1,0}, bf16[2,8,512,128]{3,2,1,0}",
    ).replace('\\"use_fused_bwd_kernel\\": false', '\\"q_layout\\": 2, \\"k_layout\\": 2')
    per_pair = 2 * 2 * 16 * 128 * 256 * 256

    def flops(tables: str, name: str = "splash_mha_fwd_residuals.3", out: str = "") -> float:
        text = line.replace("s8[1,1,1]{2,1,0}, s8[1,1,1]{2,1,0}", tables)
        text = text.replace("splash_mha_fwd_residuals.3 = (", f"{name} = ({out}")
        (inst,) = hlo_stats.parse("ENTRY %main () -> f32[] {\n" + text + "}\n").computations["main"]
        return kernel_flops.kernel_flops(inst)

    assert flops("s8[3]{0}, s8[3]{0}") == 2 * 3 * per_pair  # causal: 3 of 4 blocks
    assert flops("s8[2]{0}, s8[2]{0}") == 2 * 2 * per_pair  # a local mask: the diagonal
    assert flops("s8[1,1,1]{2,1,0}, s8[1,1,1]{2,1,0}") == 2 * 3 * per_pair  # a grid: causal
    # dK/dV with dQ fused (dq, dk, dv returned): 5 matmuls a pair.
    assert (
        flops(
            "s32[4]{0}, s32[4]{0}", "splash_mha_dkv_no_residuals.1", "bf16[2,16,512,128]{3,2,1,0}, "
        )
        == 5 * 3 * per_pair
    )


def _compile_pair(gib: float):
    """(a + 1, b * 2) of two f32 arrays of `gib` GiB each, not donated, on one v5e chip:
    its live buffers peak at 4 x gib (two arguments, two results), with no temporaries."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    x = jax.ShapeDtypeStruct(
        (int(gib * 2**30) // 4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
    )
    return device, jax.jit(lambda a, b: (a + 1, b * 2)).lower(x, x)


@needs_libtpu
def test_fits_follows_the_compilers_edge_on_both_sides():
    """XLA:TPU accepts a program whose live peak (arguments included) is within the HBM it can
    use (v5e: 15.75 GiB) and refuses one above it, however small its temporaries."""
    import jax

    device, below = _compile_pair(3.75)  # peak 15.0 GiB
    usable = aot_compile.usable_hbm_bytes(device)
    assert usable == int(15.75 * 2**30)
    memory = below.compile().memory_analysis()
    verdict = aot_compile._verdict(
        {
            "argument_size_in_bytes": memory.argument_size_in_bytes,
            "temp_size_in_bytes": memory.temp_size_in_bytes,
            "peak_memory_in_bytes": memory.peak_memory_in_bytes,
        },
        CHIPS["v5e"],
        usable,
        accepted=True,
    )
    assert verdict["fits"] and abs(verdict["per_chip_bytes"] - 15 * 2**30) < 2**20
    assert abs(verdict["headroom_bytes"] - 0.75 * 2**30) < 2**20
    _, above = _compile_pair(4.0)  # peak 16 GiB; arguments + temporaries only 8
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:
        above.compile()
    verdict = aot_compile._out_of_memory(refused.value, CHIPS["v5e"], usable, 8 * 2**30)
    assert verdict["fits"] is False and verdict["per_chip_bytes"] == 16 * 2**30  # its message
    assert verdict["args_plus_temps_bytes"] == 8 * 2**30 < usable  # not the compared figure


@needs_libtpu
def test_moe_grouped_matmuls_at_balanced_routing_equal_the_analytic_expert_flops():
    """The EP step's grouped matmuls run over worst-case receive buffers (ep x each rank's
    picks); at balanced routing they do the analytic expert work: tokens x top_k rows through
    3 matmuls, forward and backward, with what remat recomputes."""
    import dataclasses
    import sys
    from pathlib import Path

    from jax.experimental import topologies

    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from parallel_helpers import TINY, preset_overrides, tiny_config

    from titan_jax.parallel import expert_parallel
    from titan_jax.planner import inspect_step
    from titan_jax.train.trainer import build_trainer

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    args = dataclasses.replace(TINY, num_experts=8, top_k=2, moe_inter_dim=32)
    config = tiny_config(
        *preset_overrides("fsdp8"),
        "--parallelism.expert_parallel_degree",
        "4",
        "--training.mixed_precision_param",
        "auto",
    )
    trainer = build_trainer(config, list(topology.devices), model_args=args)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    picks = trainer.plan.tokens_per_step * args.top_k
    module = hlo_stats.parse(lowered.as_text(dialect="hlo", debug_info=True))
    expected, bound = hlo_stats.ragged_dot_flops(module, picks, kernel_flops.megablox_flops)
    # Per layer, in matmuls of picks x dim x inter: the forward's 3, full remat's recompute of
    # w1 and w3 (2; w2's output is not needed in backward) and the 6 gradient matmuls, which
    # take the expert FFN's residuals from that recompute.
    analytic = args.n_layers * picks * (3 + 2 + 6) * (2 * args.dim * args.moe_inter_dim)
    assert expected == pytest.approx(analytic)
    # The bound (every pick to one rank): the 11 over the capacity buffer, and 12 over the
    # overflow's buffer: its forward, and in its backward its forward again (as traced, inside
    # the VJP) and the 6 gradient matmuls (remat's recompute of its forward is dropped).
    per_rank = picks // len(topology.devices)
    capacity = expert_parallel.expert_capacity(per_rank, 4 * per_rank)
    overflow = expert_parallel.overflow_rows(per_rank, 4, capacity)
    assert bound == pytest.approx(analytic / 11 / per_rank * (11 * capacity + 12 * overflow))


# An all-gather run by another computation, started and waited for in the schedule's place:
# XLA:TPU's async wrapper, and Ironwood's asynchronous call on the SparseCore thread (started,
# updated, done).
ASYNC_GATHERS = {
    "async wrapper": (
        "%ags = ((bf16[500000000]{0}), bf16[1000000000]{0}) async-start(%w), calls=%gather",
        "async-done(%ags)",
    ),
    "sparsecore call": (
        "%ags = ((), (), (s32[1]{0})) call-start(%w), "
        'async_execution_thread="sparsecore", to_apply=%gather\n'
        "  %agu = ((), (), (s32[1]{0})) call-update(%ags)",
        "call-done(%agu)",
    ),
    # MaxText's Ironwood recipes (SparseCore collective offload): an async computation that
    # calls the one holding the gather.
    "sparsecore async call": (
        "%ags = ((), (), (s32[1]{0})) async-start(%w), "
        'async_execution_thread="sparsecore", calls=%offloaded\n'
        "  %agu = ((), (), (s32[1]{0})) async-update(%ags)",
        "async-done(%agu)",
    ),
}


@pytest.mark.parametrize("form", sorted(ASYNC_GATHERS))
def test_an_all_gather_run_asynchronously_is_covered_by_the_work_between_start_and_done(form):
    start, done = ASYNC_GATHERS[form]
    text = SCHEDULE.replace(
        "%ags = (bf16[500000000]{0}, bf16[1000000000]{0}) all-gather-start(%w), "
        "replica_groups=mesh['x'=2,'y'=4] {'x'}, dimensions={0}",
        start,
    )
    text = text.replace("all-gather-done(%ags)", done)
    text = text.replace(
        "ENTRY",
        """%gather (g: bf16[500000000]) -> bf16[1000000000] {
  %g = bf16[500000000]{0} parameter(0)
  ROOT %ag = bf16[1000000000]{0} all-gather(%g), replica_groups=mesh['x'=2,'y'=4] {'x'}, dimensions={0}
}

%offloaded (o: bf16[500000000]) -> bf16[1000000000] {
  %o = bf16[500000000]{0} parameter(0)
  ROOT %c = bf16[1000000000]{0} call(%o), to_apply=%gather
}

ENTRY""",
    )
    r = hlo_cost.estimate(text, UNIT_CHIP, 8)
    gather = next(c for c in r["collectives"] if c["op"] == "all-gather")
    assert gather["seconds"] == pytest.approx(1.0) and gather["overlap"] == 1.0
    assert r["exposed_collective_s"] == pytest.approx(1.0)  # the all-reduce only
    assert r["compute_s"] == pytest.approx(6.0)  # the transfer itself is not compute


def test_the_report_hints_the_overlap_flags_it_lacks_only_when_gathers_lie_exposed():
    report = {
        "model": "qwen3 8B",
        "topology": "v6e-8",
        "num_slices": 1,
        "chips": 8,
        "tpu": "v6e:2x4",
        "mesh": {"fsdp": 8},
        "mode": "fully_shard",
        "fsdp_implementation": "jit",
        "param_dtype": "bfloat16",
        "activation_checkpoint": "full",
        "attention": "splash",
        "memory": {"argument_size_in_bytes": 1},
        "per_chip_bytes": 2,
        "usable_hbm_bytes": 4,
        "hbm_bytes": 5,
        "fits": True,
        "headroom_bytes": 2,
        "args_plus_temps_bytes": 3,
        "analytic_flops_per_step": 1.0,
        "flops_per_step": 1.0,
        "grouped_matmul_flops_bound_per_step": 0,
        "lower_s": 1.0,
        "compile_s": 1.0,
        "collectives": [],
        "in_loop_all_gathers": 18,
        "in_loop_all_gather_s": 0.05,
        "in_loop_all_gather_overlap_pct": 0.0,
        "in_loop_all_gather_min_overlap_pct": 0.0,
        "scheduler_flags": {"xla_enable_async_all_gather": "auto"},
        "est_step_time_s": None,
    }
    assert "hint: LIBTPU_INIT_ARGS='--xla_enable_async_all_gather=true' (" in (
        aot_compile.format_report(report)
    )
    offload = "xla_tpu_enable_sparse_core_collective_offload_all_gather"
    report["scheduler_flags"] = {"xla_enable_async_all_gather": "true", offload: "false"}
    assert f"hint: LIBTPU_INIT_ARGS='--{offload}=true' (" in aot_compile.format_report(report)
    report["scheduler_flags"] = {"xla_enable_async_all_gather": "true", offload: "true"}
    assert "hint" not in aot_compile.format_report(report)
    report.update(scheduler_flags={}, in_loop_all_gather_overlap_pct=95.0)
    assert "hint" not in aot_compile.format_report(report)


EXCHANGE_PARAMETERS = """
HloModule m

ENTRY %main (picks: bf16[24,64], z96: bf16[96,64], z24: bf16[24,64], o: s32[4]) -> bf16[24,64] {
  %picks = bf16[24,64]{1,0} parameter(0)
  %z96 = bf16[96,64]{1,0} parameter(1)
  %z24 = bf16[24,64]{1,0} parameter(2)
  %o = s32[4]{0} parameter(3)
"""
EXCHANGES = (
    EXCHANGE_PARAMETERS
    + """\
  %rows = bf16[96,64]{1,0} ragged-all-to-all(%picks, %z96, %o, %o, %o, %o), channel_id=1, replica_groups={{0,1,2,3}}
  ROOT %back = bf16[24,64]{1,0} ragged-all-to-all(%rows, %z24, %o, %o, %o, %o), channel_id=2, replica_groups={{0,1,2,3}}
}
"""
)


def test_ragged_all_to_alls_count_what_they_send_not_their_worst_case_buffers():
    """A dispatch (24 picks into a 96-row receive buffer) and its combine (the 96-row buffer's
    results back into 24 rows) each send the 24 picks' bytes at balanced routing."""
    module = hlo_stats.parse(EXCHANGES)
    ops = hlo_stats.collective_ops(module)
    assert [c["bytes"] for c in ops] == [24 * 64 * 2] * 2
    defs = module.defining("main")
    assert [
        hlo_cost.collective_bytes(defs[n], "ragged-all-to-all", defs) for n in ("rows", "back")
    ] == [24 * 64 * 2] * 2


# The same two exchanges as libtpu 0.0.50 emits them: async, the start typed ((operands), result,
# context scalars).
ASYNC_EXCHANGES = (
    EXCHANGE_PARAMETERS
    + """\
  %go = ((bf16[24,64]{1,0}, bf16[96,64]{1,0}, s32[4]{0}, s32[4]{0}, s32[4]{0}, /*index=5*/s32[4]{0}), bf16[96,64]{1,0}, u32[], u32[]) ragged-all-to-all-start(%picks, %z96, %o, %o, %o, /*index=5*/%o), channel_id=1, replica_groups={{0,1,2,3}}
  %rows = bf16[96,64]{1,0} ragged-all-to-all-done(%go)
  %back-go = ((bf16[96,64]{1,0}, bf16[24,64]{1,0}, s32[4]{0}, s32[4]{0}, s32[4]{0}, /*index=5*/s32[4]{0}), bf16[24,64]{1,0}, u32[], u32[]) ragged-all-to-all-start(%rows, %z24, %o, %o, %o, /*index=5*/%o), channel_id=2, replica_groups={{0,1,2,3}}
  ROOT %back = bf16[24,64]{1,0} ragged-all-to-all-done(%back-go)
}
"""
)


def test_async_ragged_all_to_alls_count_what_they_send():
    module = hlo_stats.parse(ASYNC_EXCHANGES)
    assert [c["bytes"] for c in hlo_stats.collective_ops(module)] == [24 * 64 * 2] * 2
    defs = module.defining("main")
    assert [
        hlo_cost.collective_bytes(defs[n], "ragged-all-to-all", defs) for n in ("go", "back-go")
    ] == [24 * 64 * 2] * 2


def test_operands_past_the_fifth_are_read_through_the_printers_index_comment():
    """XLA prints `/*index=5*/` before every fifth operand; a fusion's sixth operand is read."""
    params = "".join(f"  %p{i} = f32[250]{{0}} parameter({i})\n" for i in range(6))
    text = (
        "%fused ("
        + ", ".join(f"q{i}: f32[250]" for i in range(6))
        + ") -> f32[250] {\n"
        + params.replace("%p", "%q")
        + "  ROOT %s = f32[250]{0} add(%q0, %q5)\n}\n\n"
        "ENTRY %main () -> f32[250] {\n" + params + "  ROOT %f = f32[250]{0} fusion(%p0, "
        "%p1, %p2, %p3, %p4, /*index=5*/%p5), kind=kLoop, calls=%fused\n}\n"
    )
    module = hlo_stats.parse(text)
    fusion = module.defining("main")["f"]
    assert fusion.operands == [f"p{i}" for i in range(6)]
    assert hlo_cost.traffic(module, fusion, module.defining("main")) == 7 * 1000


def _splash_module(
    q_space: str, kv_space: str, kind: str = "splash_mha_fwd_residuals"
) -> hlo_stats.HloModule:
    """SPLASH's kernel (batch 2, 16 query heads, 8 kv heads, 512 rows, 256-blocks: 3 of 4
    block pairs causal) with its q and k/v operands in the given memory spaces."""
    q, kv = "bf16[2,16,512,128]{3,2,1,0%s}", "bf16[2,8,512,128]{3,2,1,0%s}"
    return hlo_stats.parse(
        "ENTRY %main () -> f32[] {\n  %a = s8[1,1,1]{2,1,0} parameter(0)\n"
        "  %b = s8[1,1,1]{2,1,0} parameter(1)\n"
        f"  %q = {q % q_space} parameter(2)\n  %k = {kv % kv_space} parameter(3)\n"
        f"  %v = {kv % kv_space} parameter(4)\n  %i = s32[512,128]{{1,0:S(1)}} parameter(5)\n"
        + SPLASH.replace("splash_mha_fwd_residuals", kind)
        + "}\n"
    )


def test_splash_reads_the_streamed_side_of_attention_once_per_block_pair():
    q_bytes, kv_bytes = 2 * 16 * 512 * 128 * 2, 2 * 8 * 512 * 128 * 2
    tables = 2  # the two s8[1,1,1] block tables
    out = 2 * 512 * 128 * 4 + q_bytes
    module = _splash_module("", "")
    inst = module.defining("main")["splash_mha_fwd_residuals.3"]
    # forward: k and v for each of the 3 block pairs of every query head (2 per kv head),
    # over 2 kv blocks: 2 x 3 / 2 = 3 times each; q once
    assert kernel_flops.splash_read_factors(inst)[2:5] == [1.0, 3.0, 3.0]
    defs = module.defining("main")
    assert hlo_cost.traffic(module, inst, defs) == tables + q_bytes + 6 * kv_bytes + out
    # dK/dV: k and v once per query head, the query side once per pair (3 over 2 q blocks)
    dkv = _splash_module("", "", "splash_mha_dkv_no_residuals").defining("main")[
        "splash_mha_dkv_no_residuals.3"
    ]
    assert kernel_flops.splash_read_factors(dkv)[2:5] == [1.5, 2.0, 2.0]
    # k and v prefetched into VMEM (S(1)): their re-reads cost no HBM
    module = _splash_module("", ":S(1)")
    inst = module.defining("main")["splash_mha_fwd_residuals.3"]
    assert hlo_cost.traffic(module, inst, module.defining("main")) == tables + q_bytes + out


def test_matmuls_are_priced_at_the_share_of_the_systolic_array_they_fill():
    dot = """
ENTRY %main (a: bf16[4096,128], b: bf16[128,4096]) -> bf16[4096,4096] {
  %a = bf16[4096,128]{1,0:S(1)} parameter(0)
  %b = bf16[128,4096]{1,0:S(1)} parameter(1)
  ROOT %d = bf16[4096,4096]{1,0:S(1)} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    flops = 2.0 * 4096 * 4096 * 128
    wide = dataclasses.replace(UNIT_CHIP, mxu_dim=256)
    # contracting over 128 fills half of a 256-deep array; all of a 128-deep one
    assert hlo_cost.estimate(dot, wide, 1)["compute_s"] == pytest.approx(2 * flops / 1e12)
    narrow = dataclasses.replace(UNIT_CHIP, mxu_dim=128)
    assert hlo_cost.estimate(dot, narrow, 1)["compute_s"] == pytest.approx(flops / 1e12)
    assert hlo_cost.estimate(dot, wide, 1)["flops_per_chip"] == flops
    # splash's forward: q k^T contracts over head_dim 128 (half the array at 256), p v over a
    # 256-block (full): 1.5x its FLOPs
    (inst,) = hlo_stats.parse("ENTRY %main () -> f32[] {\n" + SPLASH + "}\n").computations["main"]
    assert kernel_flops.splash_array_flops(inst, 256) == 1.5 * kernel_flops.kernel_flops(inst)
    assert kernel_flops.splash_array_flops(inst, 128) == kernel_flops.kernel_flops(inst)


def test_a_batched_dot_written_as_a_base_dilated_convolution_counts_one_tap_per_entry():
    """XLA:TPU writes a batched dot (MaxText's MoE combine, BKE,BK -> BE) as a convolution
    over the batch whose window meets one input element in each of its dilation's holes."""
    conv = """
ENTRY %main (a: bf16[4096,8,512], b: bf16[4096,8,1]) -> bf16[4096,1,512] {
  %a = bf16[4096,8,512]{2,1,0} parameter(0)
  %b = bf16[4096,8,1]{2,1,0} parameter(1)
  ROOT %c = bf16[4096,1,512]{2,1,0} convolution(%a, %b), window={size=4096 stride=4095 lhs_dilate=4096}, dim_labels=0fb_0io->0fb
}
"""
    r = hlo_cost.estimate(conv, UNIT_CHIP, 1)
    assert r["flops_per_chip"] == 2.0 * 4096 * 512 * 8  # out x the 8 features, one tap each


def test_a_collective_naming_no_algorithm_runs_on_one_ring_of_its_groups_chips():
    """An Ironwood chip is two JAX devices on the chip's links: an unnamed gather over all 512
    devices of a tpu7x-512 is a ring of its 256 chips, closed by the 4x8x8 torus's wraps."""
    tpu = parse_slice("tpu7x-512")
    text = SCHEDULE.replace("mesh['x'=2,'y'=4] {'x'}", "mesh['x'=512] {'x'}")
    r = hlo_cost.estimate(text, tpu.chip, 512, None, tpu.ring_wraps)
    gather = next(c for c in r["collectives"] if c["op"] == "all-gather")
    assert gather["group"] == 512 and gather["wraparound"]
    assert gather["bytes_per_s"] == tpu.chip.ring_bytes_per_s(1, wraparound=True)


CODEGEN = """
  %fusion.7 = f32[2128,4096]{1,0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.1, backend_config={"collective_algorithm_config":{"emitter":"SingleInputAllReduceScatterFusion","strategy":"StrategyRing","debug":"\\nStrategyRing{colors:1 phases:1 cores:{8} nophase0:0}"}}
  %all-reduce.3 = f32[8]{0} all-reduce(%y), to_apply=%add, backend_config={"collective_algorithm_config":{"emitter":"E","strategy":"StrategyND","debug":"\\nStrategyND{colors:2 phases:2 cores:{2 2} nophase0:0}"}}
  %all-gather.9 = bf16[4096,8,128]{2,0,1} all-gather(%z), dimensions={0}, backend_config={"collective_algorithm_config":{"emitter":"2DAllGatherOnMajorDim","debug":"\\ngroup_size = 4 "}}
"""


def test_a_collective_runs_at_the_ring_bandwidth_of_the_torus_dimensions_its_algorithm_spans():
    assert hlo_cost.rings(CODEGEN) == {
        "fusion.7": (8,),
        "all-reduce.3": (2, 2),
        "all-gather.9": (0, 0),
    }
    # the published v6e figure: 800 GB/s both ways over 4 ports; a closed ring on one
    # dimension sends one way on two of them, an open one (no wraparound) on one
    v6e = CHIPS["v6e"]
    assert v6e.ring_bytes_per_s() == pytest.approx(200e9)
    assert v6e.ring_bytes_per_s(2) == v6e.ring_bytes_per_s(3) == pytest.approx(400e9)
    assert v6e.ring_bytes_per_s(1, wraparound=False) == pytest.approx(100e9)
    # SCHEDULE's synchronous all-reduce (1 GB over ICI, 1 s on one ring) over two dimensions
    two_dims = dataclasses.replace(UNIT_CHIP, ici_bytes_per_s=4e9, ici_ports=4)
    r = hlo_cost.estimate(SCHEDULE, two_dims, 8, {"ar": (2, 4)})
    found = {c["op"]: c for c in r["collectives"]}
    assert found["all-reduce"]["ring_dims"] == 2
    assert found["all-reduce"]["seconds"] == pytest.approx(0.5)
    # the gather names no algorithm: it takes the rings the compiler chose for the other
    # collective over groups of its size
    assert found["all-gather"]["ring_dims"] == 2
    assert hlo_cost.estimate(SCHEDULE, two_dims, 8)["exposed_collective_s"] == pytest.approx(1)
    # the same rings left open (no wraparound link) take twice as long
    open_rings = hlo_cost.estimate(SCHEDULE, two_dims, 8, {"ar": (2, 4)}, lambda sizes: False)
    found = {c["op"]: c for c in open_rings["collectives"]}
    assert found["all-reduce"]["seconds"] == pytest.approx(1.0)
    assert not found["all-reduce"]["wraparound"]


@pytest.mark.parametrize(
    ("name", "shape", "closed", "open_"),
    [
        # v6e/v5e: only a dimension spanning the pod's 16 wraps
        ("v6e-8", (2, 4), (), [(8,), (2,), (4,), (2, 4), (0,)]),
        ("v6e-128", (8, 16), (16,), [(8,), (128,), (8, 16)]),
        ("v5e-256", (16, 16), (16, 16), []),
        # v5p: whole 4x4x4 cubes wrap every dimension, smaller slices none
        ("v5p-8", (2, 2, 1), (), [(2, 2), (4,)]),
        ("v5p-64", (2, 4, 4), (), [(4,), (4, 4)]),
        ("v5p-128", (4, 4, 4), (4, 4, 4), [(2,), (3,)]),
    ],
)
def test_which_rings_a_slice_closes_with_wraparound_links(name, shape, closed, open_):
    tpu = parse_slice(name)
    assert tpu.shape == shape and tpu.wrapped_lengths == closed
    assert tpu.libtpu_name == f"{tpu.chip.generation}:{'x'.join(map(str, shape))}"
    for sizes in open_:
        assert not tpu.ring_wraps(sizes), sizes
    if len(closed) == len(shape):  # a full torus: rings over its planes and unnamed sizes too
        for sizes in [(shape[0],), (shape[0] * shape[1],), (0, 0), (shape[0], shape[1])]:
            assert tpu.ring_wraps(sizes), sizes
    assert tpu.ring_wraps((1,))


# tokamax's quantized grouped matmuls as XLA:TPU prints them (`[quantize]` experts on TPU):
# int8 values, and their bf16 scales broadcast to tiles, among the operands.
_QUANTIZED_GMM = (
    "  %pallas_tpu_ragged_dot_gmm.5 = bf16[512,256]{1,0} custom-call(%a, %b, %c, %d, %e, "
    '/*index=5*/%x_q, %x_s, %w_q, %w_s), custom_call_target="tpu_custom_call", '
    "operand_layout_constraints={s32[1]{0}, s32[5]{0}, s32[7]{0}, s32[7]{0}, s32[1]{0}, "
    "s8[512,128]{1,0}, bf16[512,128]{1,0}, s8[4,128,256]{2,1,0}, bf16[4,8,256]{2,1,0}}\n"
)
_QUANTIZED_TGMM = (
    "  %pallas_tpu_ragged_dot_tgmm.2 = bf16[4,128,256]{2,1,0} custom-call(%a, %b, %c, %d, %e, "
    '/*index=5*/%x_q, %x_s, %g_q, %g_s), custom_call_target="tpu_custom_call", '
    "operand_layout_constraints={s32[1]{0}, s32[5]{0}, s32[7]{0}, s32[7]{0}, s32[1]{0}, "
    "s8[512,128]{1,0}, bf16[8,128]{1,0}, s8[512,256]{1,0}, bf16[8,256]{1,0}}\n"
)


def test_quantized_grouped_matmuls_count_their_values_and_run_at_the_low_precision_rate():
    """The values, not the scales broadcast to the values' shape, are the matrices: 2 x 512
    rows x 128 x 256 for both kernels; on v5p int8 runs at twice bf16's rate."""
    module = hlo_stats.parse(
        "ENTRY %main () -> f32[] {\n" + _QUANTIZED_GMM + _QUANTIZED_TGMM + "}\n"
    )
    gmm, tgmm = module.computations[module.entry]
    for kernel in (gmm, tgmm):
        assert kernel_flops.kernel_flops(kernel) == 2 * 512 * 128 * 256
        flops, spent = mxu_work.instruction_work(kernel, {}, 128, CHIPS["v5p"].mxu_time_factors)
        assert spent == flops / 2
        assert mxu_work.instruction_work(kernel, {}, 128, {})[1] == flops  # v4: no int8 rate


# A bf16 megablox gmm over a 512-row buffer (say, an EP receive buffer) of 4 experts.
GMM_PROGRAM = """
HloModule m, is_scheduled=true

ENTRY %main (x: bf16[512,128], w: bf16[4,128,256], g: s32[4]) -> bf16[512,256] {
  %x = bf16[512,128]{1,0} parameter(0)
  %w = bf16[4,128,256]{2,1,0} parameter(1)
  %g = s32[4]{0} parameter(2)
  ROOT %gmm.1 = bf16[512,256]{1,0} custom-call(%g, %x, %w), custom_call_target="tpu_custom_call", operand_layout_constraints={s32[4]{0}, bf16[512,128]{1,0}, bf16[4,128,256]{2,1,0}}
}
"""


def test_a_grouped_matmul_is_priced_at_the_rows_balanced_routing_fills():
    whole = hlo_cost.estimate(GMM_PROGRAM, UNIT_CHIP, 1)
    assert whole["flops_per_chip"] == 2 * 512 * 128 * 256
    rows_bytes, weight_bytes = 2 * 512 * (128 + 256), 2 * 4 * 128 * 256
    assert whole["hbm_bytes_per_chip"] == rows_bytes + weight_bytes + 4 * 4
    # 128 picks a device at balanced routing: the kernel visits a quarter of the buffer's
    # row tiles; the experts' weights are read whole.
    routed = hlo_cost.estimate(GMM_PROGRAM, UNIT_CHIP, 1, routed_rows=128)
    assert routed["flops_per_chip"] == whole["flops_per_chip"] / 4
    assert routed["hbm_bytes_per_chip"] == rows_bytes / 4 + weight_bytes + 4 * 4
    # more picks than the buffer holds never price more than the buffer
    assert hlo_cost.estimate(GMM_PROGRAM, UNIT_CHIP, 1, routed_rows=4096) == whole


@pytest.mark.parametrize(
    "marked, priced",
    [("costly", "costly"), ("cheap", "cheap"), ("rare costly", "cheap"), (None, "costly")],
)
def test_a_conditional_is_priced_by_the_branch_a_step_takes(marked, priced):
    """A program compiled here (CPU HLO: the same conditional and metadata): the branch traced
    under `expected_branch` (a finite loss, balanced routing), or the sibling of one traced
    under `rare_branch`, is priced, FLOPs and bytes once; unmarked, the costlier; the other
    branch is reported beside it."""
    import jax
    import jax.numpy as jnp

    from titan_jax.planner_hints import expected_branch, rare_branch

    n = 256
    branches = {"costly": lambda x: x @ x @ x, "cheap": lambda x: x * 2}
    costly, cheap = (
        expected_branch(f) if name == marked else rare_branch(f) if f"rare {name}" == marked else f
        for name, f in branches.items()
    )
    step = jax.jit(lambda p, x: jax.lax.cond(p, costly, cheap, x))
    r = hlo_cost.estimate(step.lower(True, jnp.ones((n, n))).compile().as_text(), UNIT_CHIP, 1)
    assert r["flops_per_chip"] == (2 * 2 * n**3 if priced == "costly" else 0)
    (conditional,) = r["conditionals"]
    assert conditional["expected"] == (marked is not None)
    (other,) = conditional["others"]
    assert (other["seconds"] < conditional["seconds"]) == (priced == "costly")
    # the branch's HBM traffic alone: the cheap one reads and writes one n x n array
    assert (r["hbm_bytes_per_chip"] > 3 * 4 * n * n) == (priced == "costly")


def test_ring_traffic_per_device():
    assert hlo_cost.moved_bytes("all-gather", 800, 4) == 600  # receives the 3 shards it lacks
    assert hlo_cost.moved_bytes("reduce-scatter", 200, 4) == 600
    assert hlo_cost.moved_bytes("all-reduce", 800, 4) == 1200
    assert hlo_cost.moved_bytes("all-reduce", 800, 1) == 0
