"""The shipped Qwen3-MoE recipes compile for the smallest TPU slices their state fits, as shipped
(`fsdp_implementation = "auto"`), ahead of time on this CPU with libtpu.

Layers are cut to 2 (what fails to compile fails at any depth; every other dimension is the
recipe's). Each recipe's compile is a test of its own module (235B-A22B's:
`test_moe_recipe_235b_aot.py`), so that the suite's workers, which take whole modules, run the
two longest compiles side by side.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pytest
from parallel_helpers import RECIPE_AOT_MARKS
from test_tpu_aot import bf16_reductions

from titan_jax.config import ConfigError, load_config
from titan_jax.models.qwen3 import get_flavor
from titan_jax.planner import inspect_step
from titan_jax.planner.topology import compile_only_devices, parse_slice
from titan_jax.train.trainer import build_trainer

pytestmark = RECIPE_AOT_MARKS

RECIPES = {  # name -> (config, slice)
    "30B-A3B v5p-16": ("configs/qwen3_30b_a3b.toml", "v5p-16"),
    "235B-A22B v5p-256": ("configs/qwen3_235b_a22b.toml", "v5p-256"),
}


def build(name: str, *overrides: str):
    path, topology = RECIPES[name]
    config = load_config(path, list(overrides))
    args = dataclasses.replace(get_flavor(config.model.flavor), n_layers=2)
    return build_trainer(config, compile_only_devices(parse_slice(topology)), model_args=args)


def check_shipped_recipe(name: str) -> None:
    """`name` compiles at 2 layers on its slice, as shipped, and fits its chips."""
    trainer = build(name)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    compiled = lowered.compile()
    assert trainer.parallelism.implementation == "shard_map"  # what `auto` picks for MoE on TPU
    memory = compiled.memory_analysis()
    per_chip = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    assert per_chip < 95 * 2**30, (name, per_chip)  # v5p HBM
    hlo = compiled.as_text()
    assert "tgmm" in hlo and "ragged-dot" not in hlo  # the experts' megablox kernels (TPU)
    if trainer.plan.mesh.shape["ep"] > 1:
        args, ep = trainer.plan.model.args, trainer.plan.mesh.shape["ep"]
        gathered_w13 = f"bf16[{args.num_experts // ep},{args.dim},{args.moe_inter_dim}]"
        late = list(gathers_after_dispatch(hlo, gathered_w13))
        assert late == [], late
    if trainer.plan.mesh.shape["tp"] == 1:  # (TP's activation partial sums are bf16 by design)
        # Except the vocabulary split's activation-shaped (rows, dim) sums: the embedding's
        # rows (one shard contributes each: exact in bf16) and the loss's partial gradients
        # of the hidden states (activation cotangents, bf16 like TP's partial sums). Weight
        # gradients (1-D or 3-D here, or (dim, experts)) stay fp32.
        rows = re.compile(rf"= bf16\[\d+,{trainer.plan.model.args.dim}\]")
        assert [r for r in bf16_reductions(hlo) if not rows.search(r)] == []


def gathers_after_dispatch(hlo: str, shape: str) -> Iterator[str]:
    """Each layer loop body (forward; backward with its recompute) of a compiled program, by
    name, whose all-gathers of two `shape` weights (the experts' w1 and w3, as the forward uses
    them) are not both done before its first token exchange: the MoE layer ties them to its
    input, so that they gather under attention (models/qwen3/moe.py)."""
    done = re.compile(rf"= {re.escape(shape)}\{{[^}}]*\}} call-done\(")
    loops = set(re.findall(r"body=(%[\w.\-]+)", hlo))
    for computation in re.split(r"\n(?=%\S+ \()", hlo):
        lines = computation.splitlines()
        name = lines[0].partition(" ")[0]
        starts = [i for i, line in enumerate(lines) if " ragged-all-to-all-start(" in line]
        if name in loops and starts and sum(map(bool, map(done.search, lines[: starts[0]]))) < 2:
            yield name


def test_shipped_30b_recipe_compiles_and_fits():
    check_shipped_recipe("30B-A3B v5p-16")


def test_jit_implementation_with_moe_on_tpu_is_a_config_error():
    """Without expert parallelism too (whose exchanges need shard_map: its own error)."""
    with pytest.raises(ConfigError, match="fsdp_implementation=jit cannot compile MoE experts"):
        build(
            "30B-A3B v5p-16",
            *("--parallelism.fsdp_implementation", "jit"),
            *("--parallelism.expert_parallel_degree", "1"),
        )
