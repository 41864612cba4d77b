"""Expert parallelism compiled ahead of time for TPU v5p:2x2x4 (16 chips: fsdp 2 x ep 4 x tp 2)
on this CPU: the picks travel by `ragged-all-to-all` (no dense all-to-all of activations), what
the exchanges send per step is within 1.2x of the balanced picks' bytes, the experts' FFN
stays split over tp inside the exchange (EP composes with TP) and runs the megablox kernels.
One compile, shared."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import pytest
from parallel_helpers import GLOBAL_BATCH, SEQ_LEN, TINY, tiny_config

from titan_jax.parallel import expert_parallel
from titan_jax.planner import aot_compile, hlo_cost, hlo_stats, inspect_step, kernel_flops
from titan_jax.planner.topology import CHIPS
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
)

# dim 256: rows a whole number of TPU tiles (T(2,128)), so no layout padding rides along
TINY_MOE = dataclasses.replace(TINY, dim=256, num_experts=8, top_k=2, moe_inter_dim=32)
EP, TP, DATA_SHARDS = 4, 2, 8  # fsdp = DATA_SHARDS / EP


@pytest.fixture(scope="module")
def compiled(module_least_compile_effort):
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x4")
    config = tiny_config(
        "--parallelism.data_parallel_shard_degree",
        str(DATA_SHARDS),
        "--parallelism.expert_parallel_degree",
        str(EP),
        "--parallelism.tensor_parallel_degree",
        str(TP),
        "--training.local_batch_size",
        str(GLOBAL_BATCH // DATA_SHARDS),
        "--training.mixed_precision_param",
        "bfloat16",
    )
    trainer = build_trainer(config, list(topology.devices), model_args=TINY_MOE)
    assert trainer.plan.model.options.platform == "tpu"
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    compiled = hlo_stats.parse(lowered.compile().as_text())
    return (
        trainer,
        hlo_stats.collective_ops(compiled),
        compiled,
        hlo_stats.parse(lowered.as_text(dialect="hlo", debug_info=True)),
    )


def test_picks_travel_by_ragged_all_to_all_only(compiled):
    trainer, ops, _, _ = compiled
    assert trainer.parallelism.implementation == "shard_map"
    assert (trainer.plan.degrees.ep, trainer.plan.degrees.tp, trainer.plan.degrees.fsdp) == (
        EP,
        TP,
        2,
    )
    # experts over ep, their model dim over fsdp, their hidden (FFN) dim over tp
    spec = trainer.state_shardings["params"]["layers"]["moe"]["w1"].spec
    assert tuple(spec[1:]) == ("ep", "fsdp", "tp"), spec
    kinds = {(c["op"], c["dtype"]) for c in ops}
    assert ("ragged-all-to-all", "bf16") in kinds and ("all-gather", "bf16") in kinds, kinds
    dense = [c for c in ops if c["op"] == "all-to-all"]
    # what is left of dense all-to-alls: the backward's offsets (EP integers), no activations
    assert all(c["dtype"].startswith(("s", "u")) and c["bytes"] <= 64 for c in dense), dense


def test_exchanges_send_the_balanced_picks_bytes(compiled):
    _, ops, _, _ = compiled
    ragged = [c for c in ops if c["op"] == "ragged-all-to-all"]
    rows = [c for c in ragged if c["dtype"] == "bf16"]
    gates = [c for c in ragged if c["dtype"] == "f32"]
    # bf16 rows both ways, forward and backward (the experts are used in the compute dtype);
    # beside them each row's gate weight, one f32 number, which XLA:TPU sends in a (1, 128)
    # tile (a 1-D array's layout there): 512 bytes a pick
    assert len(rows) + len(gates) == len(ragged), ragged
    picks_per_chip = GLOBAL_BATCH // DATA_SHARDS * SEQ_LEN * TINY_MOE.top_k
    for exchanges, row_bytes in ((rows, TINY_MOE.dim * 2), (gates, 4 * 128)):
        balanced = picks_per_chip * row_bytes
        sent = sum(c["bytes"] * c["executions"] for c in exchanges)
        count = sum(c["executions"] for c in exchanges)
        assert balanced * count <= sent <= 1.2 * balanced * count, (sent, count)
    # per layer: rows out and back in the forward, out again in remat's recompute (the
    # outputs need not come back: the gates' gradient is taken where they are), their
    # gradients out and back; the gates out (forward, recompute), their gradient back; and as
    # many in the overflow's conditionals
    layers = TINY_MOE.n_layers
    assert sum(c["executions"] for c in rows) == (5 + 5) * layers
    assert sum(c["executions"] for c in gates) == (3 + 3) * layers


def test_experts_run_the_megablox_kernels_counted_at_the_analytic_flops(compiled):
    """On TPU the experts' SwiGLU is the Pallas megablox gmm (backward gmm + tgmm), split over
    tp per shard: no `ragged-dot` (whose weight gradient XLA:TPU makes a dense masked
    convolution over experts x buffer) nor an experts x buffer array; the compile report counts the
    kernels at balanced routing as the analytic expert work."""
    trainer, _, program, lowered = compiled
    kernels = [
        i for body in program.computations.values() for i in body if kernel_flops.megablox_flops(i)
    ]
    weight_grads = [i for i in kernels if "tgmm" in i.name]
    # in the layer loop, over the capacity buffer: gmm for the forward (3), full remat's
    # recompute of w1 and w3 (2: the FFN's backward takes its residuals from that recompute,
    # not a third forward), row gradients (3) and tgmm (3); in the overflow's conditionals its
    # forward (3: remat's recompute of it is dropped, its backward recomputes it), and in its
    # backward its forward again (3, inside its VJP), row gradients and tgmm.
    assert len(weight_grads) == 2 * 3, [i.name for i in kernels]
    assert len(kernels) == 11 + 12, [i.name for i in kernels]
    n_local = TINY_MOE.num_experts // EP
    rows = EP * GLOBAL_BATCH // DATA_SHARDS * SEQ_LEN * TINY_MOE.top_k  # the receive buffer
    masked = f"[{n_local},{rows},{TINY_MOE.dim}]"  # ragged_dot's gradient: experts x buffer
    assert not [
        i
        for body in program.computations.values()
        for i in body
        if i.name.startswith("ragged-dot") or masked in i.type
    ]
    picks = trainer.plan.tokens_per_step * TINY_MOE.top_k
    expected, bound = hlo_stats.ragged_dot_flops(
        lowered, picks, functools.partial(kernel_flops.megablox_flops, hidden_split=TP)
    )
    # Per layer, in matmuls of picks x dim x inter: the forward's 3, full remat's recompute of
    # w1 and w3 (2) and the backward's 6 gradient matmuls.
    analytic = TINY_MOE.n_layers * picks * 11 * 2 * TINY_MOE.dim * TINY_MOE.moe_inter_dim
    assert expected == pytest.approx(analytic)
    # The bound (every pick to one rank): the 11 over the capacity buffer, and 12 over the
    # overflow's buffer: its forward, and in its backward its forward again (as traced, inside
    # the VJP) and the 6 gradient matmuls (remat's recompute of its forward is dropped).
    per_rank = GLOBAL_BATCH // DATA_SHARDS * SEQ_LEN * TINY_MOE.top_k
    capacity = expert_parallel.expert_capacity(per_rank, EP * per_rank)
    overflow = expert_parallel.overflow_rows(per_rank, EP, capacity)
    assert bound == pytest.approx(analytic / 11 / per_rank * (11 * capacity + 12 * overflow))


def test_no_compute_dtype_copy_of_the_stacked_expert_weights(compiled):
    """XLA:TPU (bfloat16 propagation, loop-invariant code motion) would cast each layer-stacked
    fp32 expert weight to one bf16 copy of all layers before the layer loops, held through the
    step; `compiler_workarounds.cast_in_loop` keeps each layer casting its own slice."""
    trainer, _, program, _ = compiled
    experts = jax.tree.leaves(trainer.abstract_state()["params"]["layers"]["moe"])
    copies = [
        f"bf16[{','.join(map(str, w.sharding.shard_shape(w.shape)))}]"
        for w in experts
        if w.ndim == 4
    ]  # (layers, experts, in, out) per chip
    assert len(copies) == 3
    assert not [
        i.name
        for body in program.computations.values()
        for i in body
        if any(c in i.type for c in copies)
    ], copies


def test_no_expert_kernel_runs_on_the_whole_receive_buffer(compiled):
    """The overflow branch runs the buffer in chunks of a rank's picks (each recomputed in
    backward): no kernel takes the whole worst-case buffer at once, whose activations and
    gradients set the compiled step's peak (the compiler sizes a conditional for its larger
    branch)."""
    _, _, program, _ = compiled
    picks = GLOBAL_BATCH // DATA_SHARDS * SEQ_LEN * TINY_MOE.top_k  # a rank's, per chip
    capacity = expert_parallel.expert_capacity(picks, EP * picks)
    rows = sorted(
        {
            kernel_flops.megablox_flops(i)[1]
            for body in program.computations.values()
            for i in body
            if kernel_flops.megablox_flops(i)
        }
    )
    assert rows == sorted({picks, capacity}), rows


def test_the_estimate_prices_the_branch_and_rows_balanced_routing_takes(compiled):
    """The overflow exchange's conditionals (forward, backward) are priced
    by the branch balanced routing takes, which skips it, and the grouped matmuls at the rows
    that routing fills; every pick on one rank (the overflow through the worst-case buffer)
    bounds it."""
    trainer, _, program, _ = compiled
    n, chip = trainer.plan.mesh.size, CHIPS["v5p"]
    rows = aot_compile.routed_rows(trainer)
    assert rows == GLOBAL_BATCH // DATA_SHARDS * SEQ_LEN * TINY_MOE.top_k
    balanced = hlo_cost.estimate(program, chip, n, routed_rows=rows)
    skewed = hlo_cost.estimate(program, chip, n, costlier_branches=True)
    assert all(c["expected"] for c in balanced["conditionals"])  # each says which it takes
    fallbacks = [
        c for c in balanced["conditionals"] if any(o["seconds"] > c["seconds"] for o in c["others"])
    ]
    assert len(fallbacks) == 2 and all(c["seconds"] < 1e-6 for c in fallbacks)
    assert balanced["flops_per_chip"] < skewed["flops_per_chip"]
    assert balanced["hbm_bytes_per_chip"] < skewed["hbm_bytes_per_chip"]
    assert balanced["step_s"] < skewed["step_s"]
