"""The run plan: every decision of a run made once, in order, and frozen; the trainer assembled
from it decides nothing."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from tiny_model import TINY

from titan_jax.config import ConfigError, load_config
from titan_jax.parallel.rules import GATHERED_VOCAB
from titan_jax.parallel.simple_fsdp import JitSimpleFSDP, ShardMapSimpleFSDP
from titan_jax.train.run_plan import plan_run
from titan_jax.train.trainer import assemble_trainer


def config(*overrides):
    return load_config(
        None, ["--training.seq_len", "16", "--training.local_batch_size", "2", *overrides]
    )


def test_a_plan_holds_every_decision_and_is_frozen():
    plan = plan_run(
        config(
            "--parallelism.data_parallel_shard_degree", "4", "--training.global_batch_size", "16"
        ),
        jax.devices()[:4],
        TINY,
    )
    assert plan.fsdp is JitSimpleFSDP  # auto, without cp
    assert plan.param_dtype == jnp.float32 and plan.attention == "xla"  # CPU devices
    assert plan.n_microbatches == 2 and plan.global_batch_size == 16
    assert dict(plan.mesh.shape)["fsdp"] == 4 and plan.model.args == TINY
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.attention = "splash"
    trainer = assemble_trainer(plan)
    assert trainer.plan is plan and trainer.batches.global_batch_size == 16
    assert isinstance(trainer.parallelism, JitSimpleFSDP)
    assert trainer.batches.sharding.spec == plan.rules.batch_spec


def test_context_parallelism_plans_the_shard_map_implementation():
    plan = plan_run(config("--parallelism.context_parallel_degree", "2"), jax.devices()[:2], TINY)
    assert plan.fsdp is ShardMapSimpleFSDP and plan.degrees.cp == 2


@pytest.mark.parametrize("implementation, split", [("shard_map", True), ("jit", False)])
def test_hsdp_keeps_the_vocabulary_split_where_the_implementation_can(implementation, split):
    plan = plan_run(
        config(
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.fsdp_implementation",
            implementation,
        ),
        jax.devices()[:4],
        TINY,
    )
    assert (plan.rules.table["vocab"] != GATHERED_VOCAB["vocab"]) == split


def test_a_refused_decision_names_its_field_before_anything_is_built():
    with pytest.raises(ConfigError, match="tensor_parallel_degree=3 must divide n_heads=4"):
        plan_run(config("--parallelism.tensor_parallel_degree", "3"), jax.devices()[:3], TINY)


@pytest.mark.parametrize("local_batch, split", [(2, True), (32, False)])
def test_the_vocabulary_stays_split_while_its_tokens_move_fewer_bytes_than_its_tables(
    local_batch, split
):
    """Split, a microbatch's tokens over the vocabulary's shards travel: 2 x 64 x 4 = 512 of
    them against TINY's 2048 rows keeps the split; 32 x 64 x 4 = 8192 gathers the tables."""
    plan = plan_run(
        config(
            "--parallelism.data_parallel_shard_degree",
            "4",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            str(local_batch),
        ),
        jax.devices()[:4],
        TINY,
    )
    assert (plan.rules.table["vocab"] != GATHERED_VOCAB["vocab"]) == split


@pytest.mark.parametrize(
    "overrides, match",
    [
        (("--activation_checkpoint.mode", "none"), "offload_layer_input=true needs a remat mode"),
        (
            ("--activation_checkpoint.mode", "full", "--parallelism.fsdp_lookahead_gather", "true"),
            "does not combine with parallelism.fsdp_lookahead_gather",
        ),
    ],
)
def test_layer_input_offload_is_refused_where_no_remat_policy_can_offload_it(overrides, match):
    with pytest.raises(ConfigError, match=match):
        plan_run(
            config("--activation_checkpoint.offload_layer_input", "true", *overrides),
            jax.devices()[:1],
            TINY,
        )


def test_layer_input_offload_is_off_on_cpu_devices_with_a_warning(caplog):
    plan = plan_run(
        config(
            "--activation_checkpoint.offload_layer_input",
            "true",
            "--activation_checkpoint.mode",
            "full",
        ),
        jax.devices()[:1],
        TINY,
    )
    assert not plan.model.options.offload_layer_input
    assert "offload_layer_input on CPU devices is off" in caplog.text


def test_every_derived_number_is_the_plans_next_to_its_inputs():
    """A MoE run over fsdp 2 x ep 2: the numbers the step, the tools and the rules table read
    (tokens, travelling tokens, expert rows, the reduce dtype, the exchanges) are the plan's,
    and the assembled SimpleFSDP takes them from there."""
    moe = dataclasses.replace(TINY, num_experts=8, top_k=2, moe_inter_dim=32)
    plan = plan_run(
        config(
            *("--parallelism.data_parallel_shard_degree", "4"),
            *("--parallelism.expert_parallel_degree", "2"),
            *("--parallelism.expert_parallel_chunks", "2"),
            *("--training.global_batch_size", "16"),
        ),
        jax.devices()[:4],
        moe,
    )
    assert (plan.degrees.fsdp, plan.degrees.ep, plan.n_microbatches) == (2, 2, 2)
    assert plan.tokens_per_step == 16 * 16
    assert plan.travelling_tokens == 2 * 16 * 2 * 2  # a microbatch over fsdp x ep
    assert plan.expert_rows_per_device == 2 * 16 * 2  # local rows x seq_len x top_k
    assert plan.expert_rows_per_step == 16 * 16 * 2
    assert plan.reduce_dtype == jnp.float32 and plan.ep_chunks == 2
    fsdp = assemble_trainer(plan).parallelism
    assert (fsdp.reduce_dtype, fsdp.cp_method, fsdp.ep_chunks) == (jnp.float32, "allgather", 2)
    dense = plan_run(config(), jax.devices()[:1], TINY)
    assert dense.expert_rows_per_device is None and dense.expert_rows_per_step is None
