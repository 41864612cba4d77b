"""SimpleFSDP (titan_jax/parallel/simple_fsdp/) on 8 simulated CPU devices.

Sharded runs must reproduce the 1-device losses; the compiled step must gather in the param
dtype and reduce gradients in fp32; reshard_after_forward must re-gather in backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from parallel_helpers import (
    GLOBAL_BATCH,
    PRESETS,
    SEQ_LEN,
    TINY,
    preset_overrides,
    single_device_overrides,
    tiny_trainer,
)

from titan_jax.config import ConfigError, load_config
from titan_jax.planner import inspect_step
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

FLOAT_DTYPES = {"bf16", "f16", "f32", "f64"}


@pytest.fixture(scope="module")
def reference_losses(run_tiny) -> np.ndarray:
    losses = run_tiny(*single_device_overrides(), n_devices=1)
    assert losses[-1] < 0.95 * losses[0], "the tiny model must learn, or equality proves little"
    return losses


# The look-ahead gather (full remat) trains to the same losses too (its gradients against the
# plain scan's: test_lookahead.py).
LOOKAHEAD = ("--activation_checkpoint.mode", "full", "--parallelism.fsdp_lookahead_gather", "true")


@pytest.mark.parametrize(
    "implementation, preset, extra",
    [
        # fsdp2_tp4 is left out: the same fsdp x tp path as fsdp4_tp2 (one compile less).
        *(("jit", name, ()) for name in PRESETS if name != "fsdp2_tp4"),
        ("shard_map", "fsdp8", ()),
        ("shard_map", "hsdp2x4", LOOKAHEAD),
        # The twin is manual over the data axes only, so tp composes with it too.
        pytest.param("shard_map", "fsdp4_tp2", (), marks=pytest.mark.slow),
    ],
    ids=lambda x: "lookahead" if x == LOOKAHEAD else (x or None),
)
def test_sharded_losses_equal_single_device(
    run_tiny, reference_losses, implementation, preset, extra
):
    losses = run_tiny(
        *preset_overrides(preset), "--parallelism.fsdp_implementation", implementation, *extra
    )
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "implementation, preset",
    [
        # the vocabulary split over fsdp, replicated over dp_replicate (jit HSDP gathers the
        # tables instead: rules.table_for_vocab)
        ("shard_map", "hsdp2x4"),
        pytest.param("shard_map", "fsdp4_tp2", marks=pytest.mark.slow),
    ],
)
def test_vocabulary_split_in_chunks_equals_single_device(
    run_tiny, reference_losses, monkeypatch, implementation, preset
):
    """The vocabulary-parallel lookup and loss with several chunks of tokens each (4 tokens of
    the lookup, 2 of the loss per chunk and shard)."""
    from titan_jax.models import embedding
    from titan_jax.train import loss

    trainer = tiny_trainer(
        *preset_overrides(preset), "--parallelism.fsdp_implementation", implementation
    )
    assert trainer.parallelism.vocab_split().degree == 4
    monkeypatch.setattr(embedding, "MAX_ROWS_PER_CHUNK", 4 * 4 * TINY.dim)
    monkeypatch.setattr(loss, "MAX_LOGITS_PER_CHUNK", 2 * TINY.vocab_size)
    losses = run_tiny(
        *preset_overrides(preset), "--parallelism.fsdp_implementation", implementation
    )
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, atol=0)


def test_modes_follow_the_degrees():
    modes = {name: tiny_trainer(*preset_overrides(name)).plan.degrees.mode for name in PRESETS}
    assert modes == {
        "ddp8": "replicate",
        "fsdp8": "fully_shard",
        "hsdp2x4": "hybrid_shard",
        "fsdp4_tp2": "fully_shard",
        "fsdp2_tp4": "fully_shard",
    }


def test_compute_spec_gathers_data_axes_and_keeps_tp():
    rules = tiny_trainer(*preset_overrides("fsdp4_tp2")).plan.rules
    axes, shape = ("layers", "embed", "heads", "head_dim"), (2, 64, 8, 8)
    assert rules.storage_spec("wq", axes, shape) == P(None, "fsdp", "tp")
    assert rules.compute_spec("wq", axes, shape) == P(None, None, "tp")
    # Activations: the data axes split only the batch (dp_replicate has size 1 here).
    assert rules.compute_spec("x", ("batch", "seq", "embed")) == P("fsdp")
    assert rules.compute_spec("x", ("batch", "seq", "heads", "head_dim")) == P("fsdp", None, "tp")
    assert rules.local_compute_spec("x", ("batch", "seq", "heads", "head_dim")) == P(
        None, None, "tp"
    )


def _float(collectives: list[dict], *ops: str) -> list[dict]:
    return [c for c in collectives if c["op"] in ops and c["dtype"] in FLOAT_DTYPES]


def assert_bf16_gathers_fp32_reductions(report: dict) -> None:
    """Checked in the HLO the SPMD partitioner emits: XLA:CPU widens bf16 collectives to f32
    afterwards, so the final CPU HLO cannot tell (and would pass a bf16 reduction)."""
    found = report["partitioned_collectives"]
    gathers = _float(found, "all-gather")
    reductions = _float(found, "all-reduce", "reduce-scatter", "all-to-all")
    if report["mesh"]["fsdp"] > 1:
        # Weights travel in bf16; the vocabulary split gathers hidden states in f32 (their
        # gradient is reduced in fp32): 2.5x the batch's rows at most (measured under full
        # remat, 3 gathers). A layer's weights gathered in fp32 (6.5x the rows here) exceed it.
        by_dtype = {d: sum(c["bytes"] for c in gathers if c["dtype"] == d) for d in ("bf16", "f32")}
        hidden_rows_bytes = GLOBAL_BATCH * SEQ_LEN * TINY.dim * 4
        assert {c["dtype"] for c in gathers} <= {"bf16", "f32"}, found
        assert by_dtype["bf16"] and by_dtype["f32"] <= 2.5 * hidden_rows_bytes, found
    else:
        assert not gathers, found  # DDP: weights are replicated, nothing to gather
    assert reductions and {c["dtype"] for c in reductions} == {"f32"}, found


def bf16_report(*overrides: str) -> dict:
    return inspect_step.inspect_trainer(
        tiny_trainer(*overrides, "--training.mixed_precision_param", "bfloat16")
    )


@pytest.mark.parametrize(
    "preset, implementation",
    [
        ("hsdp2x4", "jit"),  # reduce-scatter over fsdp + all-reduce over dp_replicate, both fp32
        pytest.param("ddp8", "jit", marks=pytest.mark.slow),
        pytest.param("hsdp2x4", "shard_map", marks=pytest.mark.slow),
    ],
)
def test_bf16_gathers_and_fp32_gradient_reductions(preset, implementation):
    assert_bf16_gathers_fp32_reductions(
        bf16_report(*preset_overrides(preset), "--parallelism.fsdp_implementation", implementation)
    )


def test_bf16_reduce_with_the_shard_map_twin_is_refused_on_cpu():
    """XLA:CPU aborts compiling a bf16 reduce-scatter ("Invalid binary instruction opcode
    copy"); the TPU compile is tested in test_tpu_aot.py."""
    with pytest.raises(ConfigError, match="mixed_precision_reduce=bfloat16.*shard_map.*CPU"):
        tiny_trainer(
            *preset_overrides("fsdp8"),
            "--training.mixed_precision_reduce",
            "bfloat16",
            "--parallelism.fsdp_implementation",
            "shard_map",
        )


def test_the_checks_can_fail_unpinned_cast_gathers_fp32():
    """Why gather_param pins the cast to the storage sharding: without it, propagation hoists the
    all-gather above the cast and it moves fp32."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    stored = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

    def unpinned(w: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(w.astype(jnp.bfloat16), NamedSharding(mesh, P()))

    with jax.set_mesh(mesh):
        _, text = inspect_step.compile_lowered(jax.jit(unpinned).lower(stored))
    found = _float(inspect_step.collective_counts(text), "all-gather")
    assert {c["dtype"] for c in found} == {"f32"}


def test_the_checks_can_fail_bf16_dot_reduces_in_bf16():
    """Why the jit path maps the loss over data shards: without it, GSPMD reduces a weight's
    gradient at the dot that forms it, in that dot's dtype, before any custom_vjp sees it."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def weight_grad(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.grad(lambda w: jnp.sum(jnp.einsum("bd,df->bf", x, w).astype(jnp.float32)))(w)

    with jax.set_mesh(mesh):
        _, text = inspect_step.compile_lowered(jax.jit(weight_grad).lower(w, x))
    found = _float(inspect_step.collective_counts(text), "all-reduce")
    assert {c["dtype"] for c in found} == {"bf16"}


@pytest.mark.parametrize(
    "implementation, ac_mode",
    [
        ("jit", "none"),
        pytest.param("shard_map", "full", marks=pytest.mark.slow),
    ],
)
def test_reshard_after_forward_regathers_and_saves_memory(implementation, ac_mode):
    """FSDP 8 in bf16: always re-gathers the layer weights in backward and saves less."""
    reports = {
        reshard: bf16_report(
            *preset_overrides("fsdp8"),
            "--activation_checkpoint.mode",
            ac_mode,
            "--parallelism.fsdp_reshard_after_forward",
            reshard,
            "--parallelism.fsdp_implementation",
            implementation,
        )
        for reshard in ("always", "never")
    }

    def gathers(report: dict) -> int:
        return sum(c["count"] for c in _float(report["partitioned_collectives"], "all-gather"))

    # At least the 7 matrices of a layer are gathered again inside the backward scan.
    assert gathers(reports["always"]) >= gathers(reports["never"]) + 7
    assert (
        reports["always"]["memory"]["temp_size_in_bytes"]
        < reports["never"]["memory"]["temp_size_in_bytes"]
    )
    for report in reports.values():
        assert_bf16_gathers_fp32_reductions(report)


def debugmodel_state_bytes(preset: str) -> tuple[int, int]:
    config = load_config(None, ["--model.flavor", "debugmodel", *preset_overrides(preset)])
    return inspect_step.state_bytes(build_trainer(config))


def test_fsdp8_params_and_optimizer_bytes_per_device_are_an_eighth():
    per_device, total = debugmodel_state_bytes("fsdp8")
    assert abs(per_device - total / 8) <= 0.02 * total / 8, (per_device, total)


def test_ddp_replicates_the_state():
    per_device, total = debugmodel_state_bytes("ddp8")
    assert per_device == total


def test_a_weight_split_over_two_mesh_axes_gathers_in_order():
    """`embed` is stored over (fsdp, ep), fsdp-major: the shard_map twin must gather ep first,
    or every rank sees the rows permuted (a consistent permutation that trains almost right)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from titan_jax.parallel.mesh import MeshDegrees, build_mesh
    from titan_jax.parallel.rules import ShardingRules
    from titan_jax.parallel.simple_fsdp import ShardMapSimpleFSDP

    mesh = build_mesh(MeshDegrees(1, 4, 1, ep=2))
    rules = ShardingRules(mesh)
    w = jnp.arange(16 * 3, dtype=jnp.float32).reshape(16, 3)
    specs = rules.storage_specs({"w": w}, {"w": ("embed", None)})
    assert specs["w"] == P(("fsdp", "ep"))
    assert rules.weight_layout(("embed", None)).gathered_dims == ((0, "ep"), (0, "fsdp"))
    fsdp = ShardMapSimpleFSDP(rules, specs)
    data = rules.data_axes

    def gather(shard):
        return fsdp.use_param(shard, ("embed", None), jnp.float32)[None]

    with jax.set_mesh(mesh):
        gathered = jax.jit(
            jax.shard_map(
                gather,
                mesh=mesh,
                in_specs=P(("fsdp", "ep")),
                out_specs=P(data),
                axis_names=frozenset(data),
            )
        )(jax.device_put(w, NamedSharding(mesh, specs["w"])))
    for copy in gathered:
        np.testing.assert_array_equal(copy, w)
