"""A recipe's own sharding rules (`parallelism.sharding_rules`): K/V heads kept whole over a
tensor-parallel degree that does not divide them, as MaxText's `logical_axis_rules` and
Levanter's `axis_resources` let a recipe do; bad rules refused in one line; a recipe with an
override compiles for a TPU slice."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import numpy as np
import pytest
from parallel_helpers import GLOBAL_BATCH, TINY, make_batches, run_losses, tiny_config

from titan_jax.config import ConfigError, load_config
from titan_jax.parallel.rules import DEFAULT_TABLE
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

# Two K/V heads: a tensor-parallel degree of 4 splits the 8 query heads but not them.
FEW_KV_HEADS = dataclasses.replace(TINY, n_kv_heads=2)
TP4 = (
    "--parallelism.data_parallel_shard_degree",
    "2",
    "--parallelism.tensor_parallel_degree",
    "4",
    "--training.local_batch_size",
    "4",
)


def losses(*overrides: str, n_devices: int = 8, host_state=None):
    trainer = build_trainer(
        tiny_config(*overrides), jax.devices()[:n_devices], model_args=FEW_KV_HEADS
    )
    state = jax.device_get(trainer.init_state(0)) if host_state is None else host_state
    return run_losses(trainer, state, make_batches(3)), state


def test_kv_heads_kept_whole_over_tp_give_one_devices_losses():
    """The refusal's hint, followed: both implementations then train as one device does."""
    with pytest.raises(ConfigError, match="must divide n_heads=8 and n_kv_heads=2") as refused:
        build_trainer(tiny_config(*TP4), jax.devices(), model_args=FEW_KV_HEADS)
    hint = str(refused.value).rpartition("parallelism.sharding_rules ")[2].rstrip(")")
    assert hint == "kv_heads="
    one, host_state = losses("--training.local_batch_size", str(GLOBAL_BATCH), n_devices=1)
    for implementation in ("jit", "shard_map"):
        got, _ = losses(
            *TP4,
            "--parallelism.sharding_rules",
            hint,
            "--parallelism.fsdp_implementation",
            implementation,
            host_state=host_state,
        )
        np.testing.assert_allclose(got, one, rtol=1e-6, err_msg=implementation)


@pytest.mark.slow
def test_a_per_shard_kernel_gets_the_kv_heads_of_its_query_heads():
    """splash (Pallas, interpreted here) runs per tp shard: with the K/V heads whole, each
    shard's kernel must see the K/V heads its own query heads use (models/attention.py
    `kv_split_like_queries`), not all of them: one device's losses."""
    seq = 128  # splash's smallest block
    args = dataclasses.replace(FEW_KV_HEADS, max_seq_len=seq)
    tokens = np.random.default_rng(0).integers(0, args.vocab_size, (2, GLOBAL_BATCH, seq + 1))
    batches = [
        {"inputs": t[:, :-1].astype(np.int32), "labels": t[:, 1:].astype(np.int32)} for t in tokens
    ]
    common = ("--training.seq_len", str(seq), "--model.attention", "splash")
    one = build_trainer(
        tiny_config(*common, "--training.local_batch_size", str(GLOBAL_BATCH)),
        jax.devices()[:1],
        model_args=args,
    )
    host_state = jax.device_get(one.init_state(0))
    tp = build_trainer(
        tiny_config(
            *common,
            *TP4,
            "--parallelism.sharding_rules",
            "kv_heads=",
            "--parallelism.fsdp_implementation",
            "shard_map",
        ),
        jax.devices(),
        model_args=args,
    )
    np.testing.assert_allclose(
        run_losses(tp, host_state, batches), run_losses(one, host_state, batches), rtol=1e-5
    )


def test_rules_read_from_toml_and_the_command_line(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        '[parallelism.sharding_rules]\nkv_heads = []\nmlp = "tp"\nembed = ["fsdp", "cp"]\n'
    )
    assert load_config(recipe).parallelism.sharding_rules == {
        "kv_heads": [],
        "mlp": ["tp"],
        "embed": ["fsdp", "cp"],
    }
    config = load_config(recipe, ["--parallelism.sharding_rules", "kv_heads=,embed=fsdp+cp"])
    assert config.parallelism.sharding_rules == {"kv_heads": [], "embed": ["fsdp", "cp"]}


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        (
            "kv_head=",
            "'kv_head' is not a logical axis of the sharding table; valid: "
            + ", ".join(DEFAULT_TABLE),
        ),
        ("mlp=tensor", "rule 'mlp' -> 'tensor': mesh has no axis 'tensor'"),
        ("mlp", "'mlp' is not key=name+name"),
    ],
)
def test_bad_rules_are_one_line(rules, message):
    with pytest.raises(ConfigError) as e:
        build_trainer(
            tiny_config("--parallelism.sharding_rules", rules),
            jax.devices()[:1],
            model_args=FEW_KV_HEADS,
        )
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.usefixtures("least_compile_effort")
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
)
def test_a_recipe_with_a_rule_override_compiles_for_its_slice(tmp_path):
    """Qwen3-32B (64 query, 8 K/V heads) at TP 16 on a v5p-32: the K/V heads whole on every
    tp rank, the query heads split 16 ways (layers cut to 2)."""
    from titan_jax.models.qwen3 import get_flavor
    from titan_jax.planner import inspect_step
    from titan_jax.planner.topology import compile_only_devices, parse_slice

    recipe = tmp_path / "qwen3_32b_tp16.toml"
    recipe.write_text(
        open("configs/qwen3_32b.toml")
        .read()
        .replace("tensor_parallel_degree = 4", "tensor_parallel_degree = 16")
        + "\n[parallelism.sharding_rules]\nkv_heads = []\n"
    )
    config = load_config(recipe)
    args = dataclasses.replace(get_flavor("32B"), n_layers=2)
    trainer = build_trainer(config, compile_only_devices(parse_slice("v5p-32")), model_args=args)
    assert trainer.plan.mesh.shape["tp"] == 16
    specs = trainer.plan.param_specs["layers"]["attention"]
    assert "tp" not in str(specs["wk"]) and "tp" in str(specs["wq"])
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    memory = lowered.compile().memory_analysis()
    assert memory.argument_size_in_bytes + memory.temp_size_in_bytes < 95 * 2**30
