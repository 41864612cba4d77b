"""Bad meshes fail at build time with an error naming the field or parameter (mesh.py, rules.py)."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from jax.sharding import AxisType
from parallel_helpers import TINY, tiny_config, tiny_trainer

from titan_jax.config import ConfigError
from titan_jax.parallel.mesh import build_mesh, resolve_degrees
from titan_jax.parallel.rules import DEFAULT_TABLE, ShardingRuleError, ShardingRules
from titan_jax.train.trainer import build_trainer


def test_mesh_axes_are_auto_and_ordered():
    trainer = tiny_trainer(
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "2",
    )
    assert dict(trainer.plan.mesh.shape) == {
        "pp": 1,
        "dp_replicate": 2,
        "fsdp": 2,
        "cp": 1,
        "ep": 1,
        "tp": 2,
    }
    assert trainer.plan.mesh.axis_names == ("pp", "dp_replicate", "fsdp", "cp", "ep", "tp")
    assert set(trainer.plan.mesh.axis_types) == {AxisType.Auto}


def test_fill_shard_degree():
    config = tiny_config("--parallelism.data_parallel_replicate_degree", "2")
    degrees = resolve_degrees(config.parallelism, 8)
    assert (degrees.dp_replicate, degrees.fsdp, degrees.tp, degrees.ep) == (2, 4, 1, 1)
    assert build_mesh(degrees, jax.devices()).devices.shape == (1, 2, 4, 1, 1, 1)


def test_expert_parallelism_is_carved_out_of_the_shard_degree():
    config = tiny_config(
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
    )
    degrees = resolve_degrees(config.parallelism, 8)
    assert (degrees.dp_replicate, degrees.fsdp, degrees.ep, degrees.dp_shard) == (2, 2, 2, 4)
    assert degrees.mode == "hybrid_shard" and degrees.dp == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--parallelism.data_parallel_shard_degree", "3"],
            "dp_replicate=1 x fsdp=3 x cp=1 x tp=1 = 3 but there are 8 devices",
        ),
        (["--parallelism.data_parallel_shard_degree", "4"], "= 4 but there are 8 devices"),
        (
            ["--parallelism.data_parallel_replicate_degree", "3"],
            "data_parallel_replicate_degree x tensor_parallel_degree x "
            "context_parallel_degree x pipeline_parallel_degree = 3 does "
            "not divide 8 devices",
        ),
        (
            ["--parallelism.tensor_parallel_degree", "8"],
            "tensor_parallel_degree=8 must divide n_heads=8 and n_kv_heads=4",
        ),
        (
            ["--parallelism.data_parallel_shard_degree", "8", "--training.local_batch_size", "2"],
            "training.global_batch_size=8 must be a multiple of local_batch_size x data-parallel "
            "degree = 2 x 8",
        ),
    ],
)
def test_bad_mesh_is_a_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        tiny_trainer(*overrides)


def test_tp_not_dividing_query_heads():
    args = dataclasses.replace(TINY, n_heads=6, n_kv_heads=2)
    config = tiny_config(
        "--parallelism.tensor_parallel_degree",
        "4",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.local_batch_size",
        "4",
    )
    with pytest.raises(ConfigError, match="tensor_parallel_degree=4 must divide n_heads=6"):
        build_trainer(config, model_args=args)


def test_fsdp_not_dividing_a_dimension_names_the_parameter():
    args = dataclasses.replace(TINY, dim=60)
    config = tiny_config(
        "--parallelism.data_parallel_shard_degree", "8", "--training.local_batch_size", "1"
    )
    with pytest.raises(
        ConfigError,
        match=r"layers\.attention\.wk: dimension 1 \(embed=60\) is "
        "not divisible by mesh axis fsdp=8",
    ):
        build_trainer(config, model_args=args)


def test_two_dims_on_one_mesh_axis_is_an_error():
    mesh = tiny_trainer(
        "--parallelism.data_parallel_shard_degree", "8", "--training.local_batch_size", "1"
    ).plan.mesh
    rules = ShardingRules(mesh, {**DEFAULT_TABLE, "mlp": "fsdp"})
    with pytest.raises(
        ShardingRuleError,
        match="feed_forward.w1: logical axes 'embed' and 'mlp' both map to mesh axis 'fsdp'",
    ):
        rules.storage_spec("feed_forward.w1", ("embed", "mlp"), (64, 128))


def test_unknown_fsdp_implementation_is_a_config_error():
    with pytest.raises(ConfigError, match="parallelism.fsdp_implementation='pmap'"):
        tiny_config("--parallelism.fsdp_implementation", "pmap")
