"""Pipeline parallelism (titan_jax/models/pipeline.py): every schedule on 8 devices trains like
one device (20 steps, fp32), the stages split the stacked layers over `pp`, and a checkpoint
moves between a pipelined run and one without, bit for bit."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from parallel_helpers import GLOBAL_BATCH, SEQ_LEN, TINY, make_batches, run_losses, tiny_config

from titan_jax.models.one_f_one_b import slots
from titan_jax.models.pipeline import bubble_fraction
from titan_jax.models.qwen3 import Qwen3Args
from titan_jax.parallel.mesh import MeshDegrees, build_mesh
from titan_jax.planner import inspect_step
from titan_jax.train.checkpoint import Checkpointer
from titan_jax.train.step import loss_and_grads
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

DENSE = dataclasses.replace(TINY, n_layers=4)  # pp 4, or pp 2 x 2 virtual stages: 1 layer each
DENSE8 = dataclasses.replace(TINY, n_layers=8)  # pp 4 x 2 virtual stages: 1 layer each
MOE = dataclasses.replace(DENSE, num_experts=8, top_k=2, moe_inter_dim=32)
LONG = dataclasses.replace(DENSE, max_seq_len=512)  # activations dominate the weights
STEPS = 20
CP2_LOCAL4 = ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4"]
TP2_LOCAL4 = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]


def pipeline(degree: int, schedule: str = "gpipe", virtual: int = 1, microbatches: int = -1):
    """Flags of a pipelined run; the other devices data-parallel with the batch kept at 8."""
    return [
        "--parallelism.pipeline_parallel_degree",
        str(degree),
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--parallelism.pipeline_parallel_virtual_stages",
        str(virtual),
        "--parallelism.pipeline_parallel_microbatches",
        str(microbatches),
        "--training.local_batch_size",  # 8 rows over the 8 / degree data-parallel ranks
        str(degree),
    ]


def moe_config(*overrides: str):
    return tiny_config("--moe.load_balance_coeff", "1e-2", *overrides)


def one_device_run(args: Qwen3Args) -> tuple[object, np.ndarray]:
    """A fresh init of model `args` (host arrays) and its 20 step losses on one device."""
    trainer = build_trainer(
        tiny_config("--training.local_batch_size", "8"), jax.devices()[:1], model_args=args
    )
    init = jax.device_get(trainer.init_state())
    return init, run_losses(trainer, init, make_batches(STEPS))


@pytest.fixture(scope="module")
def dense_reference():
    return one_device_run(DENSE)


@pytest.mark.parametrize(
    "flags, implementation",
    [
        (pipeline(2), "jit"),
        (pipeline(4), "jit"),
        # more microbatches than stages, beside tensor parallelism: pp2 x fsdp2 x tp2
        ([*pipeline(2, microbatches=4), *TP2_LOCAL4], "jit"),
        (pipeline(2, "interleaved", 2), "jit"),
        (pipeline(2), "shard_map"),
        ([*pipeline(2), *CP2_LOCAL4], "shard_map"),  # pp2 x fsdp2 x cp2
        (pipeline(2, "1f1b"), "jit"),
        (pipeline(4, "1f1b"), "jit"),
        ([*pipeline(2, "1f1b", microbatches=4), *TP2_LOCAL4], "jit"),
        (pipeline(2, "1f1b"), "shard_map"),
    ],
    ids=[
        "gpipe_pp2",
        "gpipe_pp4",
        "gpipe_pp2_m4_tp2",
        "interleaved_pp2_v2",
        "gpipe_pp2_shard_map",
        "gpipe_pp2_cp2",
        "1f1b_pp2",
        "1f1b_pp4",
        "1f1b_pp2_m4_tp2",
        "1f1b_pp2_shard_map",
    ],
)
def test_schedules_equal_one_device(dense_reference, flags, implementation):
    init, want = dense_reference
    trainer = build_trainer(
        tiny_config(*flags, "--parallelism.fsdp_implementation", implementation),
        model_args=DENSE,
    )
    assert trainer.plan.mesh.shape["pp"] == int(flags[1])
    # The stacked layers are split over the stages, the embedding is not.
    params = trainer.state_shardings["params"]
    assert params["layers"]["attention"]["wq"].spec[0] == "pp"
    assert "pp" not in str(params["tok_embeddings"].spec)
    np.testing.assert_allclose(run_losses(trainer, init, make_batches(STEPS)), want, rtol=1e-5)


@pytest.fixture(scope="module")
def dense8_reference():
    return one_device_run(DENSE8)


def test_interleaved_pp4_v2_equals_one_device(dense8_reference):
    """8 chunks of one layer, chunk c on stage c mod 4: each microbatch goes around the 4
    stages twice, its second pass entering stage 0 from the slot the last stage wrote."""
    init, want = dense8_reference
    trainer = build_trainer(tiny_config(*pipeline(4, "interleaved", 2)), model_args=DENSE8)
    assert trainer.plan.mesh.shape["pp"] == 4
    np.testing.assert_allclose(run_losses(trainer, init, make_batches(STEPS)), want, rtol=1e-5)


@pytest.fixture(scope="module")
def moe_reference():
    reference = build_trainer(
        moe_config("--training.local_batch_size", "8"), jax.devices()[:1], model_args=MOE
    )
    init = jax.device_get(reference.init_state())
    # A sharp router, as tests/parallel/test_moe_training.py: near-ties would flip top-k picks
    # on a reduction order.
    init["params"]["layers"]["moe"]["gate"] = init["params"]["layers"]["moe"]["gate"] * 50
    return init, run_losses(reference, init, make_batches(STEPS))


@pytest.mark.slow  # ~35 s a schedule here, and the one-device reference once
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_moe_pp2_fsdp2_ep2_equals_one_device(moe_reference, schedule):
    """Expert parallelism takes the shard_map implementation, where GPipe's stages hold pp
    manual (as MoE runs on TPU: its expert kernels need every axis manual), each device its
    own stage, hand-offs by ppermute; 1F1B's stage dim leaves pp to the partitioner."""
    init, want = moe_reference
    batches = make_batches(STEPS)
    trainer = build_trainer(
        moe_config(
            *pipeline(2, schedule),
            "--parallelism.data_parallel_shard_degree",
            "4",
            "--parallelism.expert_parallel_degree",
            "2",
        ),
        model_args=MOE,
    )
    assert trainer.parallelism.pipeline_split().manual == (schedule == "gpipe")
    assert {a: n for a, n in trainer.plan.mesh.shape.items() if n > 1} == {
        "pp": 2,
        "fsdp": 2,
        "ep": 2,
    }
    np.testing.assert_allclose(run_losses(trainer, init, batches), want, rtol=1e-5)


def test_a_checkpoint_moves_between_pipelined_and_plain_runs_and_resumes_bitwise(
    dense_reference, tmp_path
):
    """Train 3 steps with pp 2, save; restore without pp, and with it: the stacked layers keep
    one layout, so both restores equal the saved state bit for bit; the resumed pipelined run
    repeats the uninterrupted one's losses bitwise, and the run without pp goes on with them."""
    init, _ = dense_reference
    batches = make_batches(5)
    config = tiny_config(*pipeline(2), "--checkpoint.enable", "true")
    piped = build_trainer(config, model_args=DENSE)
    state = jax.device_put(init, piped.state_shardings)
    for batch in batches[:3]:
        state, _ = piped.step_fn(state, piped.batches.put(batch))
    saved = jax.device_get(state)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, state, data_state={}, tokens_seen=0)
    uninterrupted = []
    for batch in batches[3:]:
        state, metrics = piped.step_fn(state, piped.batches.put(batch))
        uninterrupted.append(float(metrics["loss"]))
    plain = build_trainer(tiny_config("--training.local_batch_size", "1"), model_args=DENSE)
    for trainer in (plain, piped):
        restored = Checkpointer(tmp_path).restore(3, trainer.abstract_state()).state
        for want, got in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
    resumed = run_losses(piped, jax.device_get(restored), batches[3:])
    np.testing.assert_array_equal(resumed, uninterrupted)  # a resume is bitwise
    go_on = run_losses(plain, saved, batches[3:])
    np.testing.assert_allclose(go_on, uninterrupted, rtol=1e-5)


def test_stages_span_the_slices():
    """With 2 slices (4 CPU devices each) pp 2 crosses them: each stage is one slice."""
    devices = jax.devices()
    mesh = build_mesh(MeshDegrees(1, 2, 1, ep=2, pp=2), devices, num_slices=2)
    assert [set(mesh.devices[s].flat) for s in range(2)] == [set(devices[:4]), set(devices[4:])]


def test_bubble_fraction():
    assert bubble_fraction(4, 1, 4) == 3 / 7  # GPipe and 1F1B: (pp - 1) / (m + pp - 1)
    assert bubble_fraction(4, 2, 4) == 3 / 11  # interleaved: (pp - 1) / (v m + pp - 1)
    assert bubble_fraction(1, 1, 1) == 0


@pytest.mark.parametrize("implementation", ["jit", "shard_map"])
def test_compiled_step_runs_one_stage_a_device_and_sends_between_stages(implementation):
    """In the compiled program each device's MLP matmuls take one microbatch of its own data
    shard (16 token rows: 2 rows / 2 microbatches x 16 positions), not every stage's, and the
    stages' hand-offs are collective-permutes."""
    trainer = build_trainer(
        tiny_config(*pipeline(2), "--parallelism.fsdp_implementation", implementation),
        model_args=DENSE,
    )
    tokens = jax.ShapeDtypeStruct((8, 16), np.int32, sharding=trainer.batches.sharding)
    compiled = trainer.lower_step(
        trainer.abstract_state(), {"inputs": tokens, "labels": tokens}
    ).compile()
    text = compiled.as_text()
    # (rows, hidden) matmul outputs: the forward's (16 token rows) and the weight gradients'
    # (dim rows); with the stages' work replicated the token rows would be 32, or (2, 16).
    mlp_rows = set(re.findall(rf"f32\[([\d,]+),{DENSE.hidden_dim}\]\S* dot\(", text))
    assert mlp_rows == {"16", str(DENSE.dim)}, mlp_rows
    assert "collective-permute(" in text


@pytest.mark.parametrize(
    "implementation",
    ["jit", pytest.param("shard_map", marks=pytest.mark.slow)],  # ~35 s
)
def test_one_f_one_b_gradients_equal_gpipes(dense_reference, implementation):
    """The gradients 1F1B computes in its forward equal autodiff's through GPipe (Adam's
    scale invariance would hide a wrong scale from the losses alone)."""
    init, _ = dense_reference
    batch = make_batches(1)[0]

    def grads(schedule: str) -> tuple[float, dict]:
        flags = pipeline(2, schedule, microbatches=2)
        trainer = build_trainer(
            tiny_config(*flags, "--parallelism.fsdp_implementation", implementation),
            model_args=DENSE,
        )
        state = jax.device_put(init, trainer.state_shardings)
        step = jax.jit(
            lambda s, b: loss_and_grads(
                trainer.plan.model,
                s["params"],
                s["buffers"],
                b,
                trainer.options,
                trainer.parallelism,
            )[:2]
        )
        with jax.set_mesh(trainer.plan.mesh):
            loss, g = step(state, trainer.batches.put(batch))
        return float(loss), jax.device_get(g)

    (want_loss, want), (loss, got) = grads("gpipe"), grads("1f1b")
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.max(np.abs(w)))


def test_one_f_one_b_reduces_weight_gradients_in_fp32():
    """With bf16 weights the only bf16 reductions are one microbatch's activations (the stage
    0 input gradient, kept beside the batch); weight gradients reduce in fp32."""
    trainer = build_trainer(
        tiny_config(*pipeline(2, "1f1b"), "--training.mixed_precision_param", "bfloat16"),
        model_args=DENSE,
    )
    found = inspect_step.inspect_trainer(trainer)["partitioned_collectives"]
    reductions = [c for c in found if c["op"] in ("all-reduce", "reduce-scatter")]
    microbatch_bytes = (GLOBAL_BATCH // 4 // 2) * SEQ_LEN * DENSE.dim * 2  # 4 ranks, m 2, bf16
    assert any(c["dtype"] == "f32" for c in reductions), found
    for c in reductions:
        if c["dtype"] == "bf16":
            assert c["bytes"] == c["count"] * microbatch_bytes, found


def _temporaries(degree: int, schedule: str, microbatches: int, seq: int) -> int:
    """Temporary bytes per device of the compiled step: one row per microbatch and data rank."""
    ranks = 8 // degree
    trainer = build_trainer(
        tiny_config(
            *pipeline(degree, schedule, microbatches=microbatches),
            "--training.local_batch_size",
            str(microbatches),
            "--training.global_batch_size",
            str(microbatches * ranks),
            "--training.seq_len",
            str(seq),
            "--activation_checkpoint.mode",
            "none",  # GPipe keeps each layer's activations; 1F1B recomputes a stage's
        ),
        model_args=LONG,
    )
    tokens = jax.ShapeDtypeStruct(
        (microbatches * ranks, seq), np.int32, sharding=trainer.batches.sharding
    )
    lowered = trainer.lower_step(trainer.abstract_state(), {"inputs": tokens, "labels": tokens})
    return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # 4 compiles, ~45-60 s each degree here
@pytest.mark.parametrize("degree", [2, 4])
def test_one_f_one_b_keeps_a_bounded_number_of_stage_inputs(degree):
    """Compiled steps (no remat) with m = degree and m = 4 x degree microbatches (one row each,
    512 tokens: each layer's attention probabilities, heads x T x T, dwarf a stage input).
    GPipe keeps every microbatch's activations, so its temporaries grow by at least the added
    microbatches' attention probabilities in each of a stage's layers; 1F1B keeps 2 (p - 1)
    stage inputs whatever m, so its grow only by batch-sized arrays (the added microbatches'
    inputs and their gradient, each a stage input's size; twice that as margin)."""
    seq, added = 512, 3 * degree
    input_bytes = seq * LONG.dim * 4  # one microbatch's stage input, fp32
    probs_bytes = LONG.n_heads * seq * seq * 4  # one layer's attention probabilities
    per_stage = LONG.n_layers // degree
    gpipe = [_temporaries(degree, "gpipe", m, seq) for m in (degree, 4 * degree)]
    f1b = [_temporaries(degree, "1f1b", m, seq) for m in (degree, 4 * degree)]
    assert gpipe[1] - gpipe[0] >= added * per_stage * probs_bytes, gpipe
    assert f1b[1] - f1b[0] <= added * 2 * 2 * input_bytes, f1b
    assert f1b[0] >= slots(degree) * input_bytes, f1b  # the ring of saved stage inputs


@pytest.mark.usefixtures("least_compile_effort")
@pytest.mark.slow
def test_on_tpu_pipeline_stages_host_splash_and_the_expert_kernels():
    """On TPU, GPipe's stages on the shard_map path hold pp manual, so splash attention and a
    MoE model's megablox kernels lower inside them (the stages' hand-offs collective-permutes);
    1F1B's stage dim leaves pp automatic, where they do not: refused in one line whose hint
    (gpipe) compiles."""
    from jax.experimental import topologies

    from titan_jax.config import ConfigError

    devices = list(topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2").devices)
    dense = dataclasses.replace(DENSE, head_dim=128, max_seq_len=256)  # splash's shapes
    moe = dataclasses.replace(MOE, head_dim=128, max_seq_len=256, dim=128, moe_inter_dim=128)

    def compiled(args: Qwen3Args, schedule: str, *flags: str) -> str:
        config = (moe_config if args.is_moe else tiny_config)(
            *pipeline(2, schedule),
            "--training.seq_len",
            "256",
            "--training.mixed_precision_param",
            "bfloat16",
            "--model.attention",
            "splash",
            *flags,
        )
        trainer = build_trainer(config, devices, model_args=args)
        batch = inspect_step.abstract_batch(trainer)
        return trainer.lower_step(trainer.abstract_state(), batch).compile().as_text()

    compiled(dense, "gpipe", "--parallelism.fsdp_implementation", "jit")
    hlo = compiled(dense, "gpipe", "--parallelism.fsdp_implementation", "shard_map")
    assert "splash" in hlo and "collective-permute" in hlo
    with pytest.raises(ConfigError, match="1f1b with splash attention needs .*schedule=gpipe"):
        compiled(dense, "1f1b", "--parallelism.fsdp_implementation", "shard_map")
    ep2 = ("--parallelism.expert_parallel_degree", "2")
    hlo = compiled(moe, "gpipe", *ep2)  # pp2 x fsdp4 (ep2 of it): the shard_map path (auto)
    assert "tgmm" in hlo and "collective-permute" in hlo  # megablox's kernels in the stages
    with pytest.raises(ConfigError, match="cannot pipeline a MoE model on TPU .*schedule=gpipe"):
        compiled(moe, "1f1b", *ep2)
