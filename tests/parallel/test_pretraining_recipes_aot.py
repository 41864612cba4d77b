"""The shipped dense and long-context pre-training recipes compile ahead of time for the TPU
slices they are planned on (the smaller dense ones: v5p-8, the smallest v5p slice), as shipped,
and fit their chips. Layers are cut to 2 (what fails to compile fails at any depth); the
full-depth figures are `make plans`' (docs/TPU.md).

With the MoE recipes (test_moe_recipes_aot.py, test_moe_recipe_235b_aot.py), the post-training
ones (test_posttraining_recipes_aot.py, test_qlora_aot.py) and the debug ones, which train on
this CPU, every recipe in configs/ is compiled by one test: the last test here says so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import test_moe_recipes_aot
import test_posttraining_recipes_aot
import test_qlora_aot
from parallel_helpers import RECIPE_AOT_MARKS

from titan_jax.config import load_config
from titan_jax.models.qwen3 import get_flavor
from titan_jax.planner import inspect_step
from titan_jax.planner.topology import compile_only_devices, parse_slice
from titan_jax.train.trainer import build_trainer

pytestmark = RECIPE_AOT_MARKS

RECIPES = {  # recipe -> the slice it is planned on
    "configs/qwen3_0.6b.toml": "v5p-8",
    "configs/qwen3_1.7b.toml": "v5p-8",
    "configs/qwen3_4b.toml": "v5p-8",
    "configs/qwen3_8b.toml": "v6e-8",  # the TorchTitan TPU fork's slice
    "configs/qwen3_14b.toml": "v5p-8",
    "configs/qwen3_32b.toml": "v5p-32",
    "configs/qwen3_8b_32k.toml": "v6e-8",
    "configs/qwen3_30b_a3b_32k.toml": "v5p-16",
}
HBM = {"v5p": 95, "v6e": 32, "v5e": 16}  # GiB a chip


@pytest.mark.parametrize(("recipe", "topology"), RECIPES.items())
def test_pretraining_recipe_compiles_and_fits(recipe, topology):
    config = load_config(recipe)
    args = dataclasses.replace(get_flavor(config.model.flavor), n_layers=2)
    trainer = build_trainer(config, compile_only_devices(parse_slice(topology)), model_args=args)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    memory = lowered.compile().memory_analysis()
    per_chip = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    assert per_chip < HBM[topology.split("-")[0]] * 2**30, (recipe, per_chip / 2**30)


def test_every_shipped_recipe_is_compiled_by_one_test():
    compiled = [
        *RECIPES,
        *(path for path, _ in test_moe_recipes_aot.RECIPES.values()),
        *test_posttraining_recipes_aot.RECIPES,
        *test_qlora_aot.RECIPES,
    ]
    shipped = sorted(str(p) for p in Path("configs").glob("*.toml") if "debug" not in p.name)
    assert sorted(compiled) == shipped
