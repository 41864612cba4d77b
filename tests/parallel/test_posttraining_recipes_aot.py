"""The shipped post-training recipes compile ahead of time for the TPU slices they are planned
on (`make plans` rows "8B SFT ...", "8B LoRA ...", "30B-A3B LoRA ..."; the QLoRA recipe's is
test_qlora_aot.py), as shipped, and fit their chips. Layers are cut to 2 (what fails to
compile fails at any depth); the frozen base of a LoRA recipe has no gradient and no optimizer
state in the compiled step, nor, for expert adapters, a kernel computing one of the experts'
size."""

from __future__ import annotations

import dataclasses
import re

import jax
import pytest
from parallel_helpers import RECIPE_AOT_MARKS

from titan_jax.config import load_config
from titan_jax.models.qwen3 import get_flavor
from titan_jax.planner import inspect_step
from titan_jax.planner.topology import compile_only_devices, parse_slice
from titan_jax.train.trainer import build_trainer
from titan_jax.trees import split_by_name

pytestmark = RECIPE_AOT_MARKS

HBM = {"v5p": 95, "v6e": 32, "v5e": 16}  # GiB a chip


RECIPES = {  # recipe -> the slice it is planned on
    "configs/qwen3_8b_sft.toml": "v6e-8",
    "configs/qwen3_8b_lora.toml": "v5e-4",
    "configs/qwen3_30b_a3b_lora.toml": "v5p-8",
}


@pytest.mark.parametrize(("recipe", "topology"), RECIPES.items())
def test_posttraining_recipe_compiles_and_fits(recipe, topology):
    config = load_config(recipe)
    args = dataclasses.replace(get_flavor(config.model.flavor), n_layers=2)
    trainer = build_trainer(config, compile_only_devices(parse_slice(topology)), model_args=args)
    state = trainer.abstract_state()
    if config.lora.rank:  # Adam's moments for the adapters only
        adapters, base = split_by_name(state["params"], trainer.plan.model.trainable)
        moments = {x.shape for x in jax.tree.leaves(state["opt_state"]) if x.ndim}
        assert moments == {x.shape for x in jax.tree.leaves(adapters)}
        assert not moments & {x.shape for x in jax.tree.leaves(base)}
    compiled = trainer.lower_step(state, inspect_step.abstract_batch(trainer)).compile()
    memory = compiled.memory_analysis()
    per_chip = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    assert per_chip < HBM[topology.split("-")[0]] * 2**30, (recipe, per_chip / 2**30)
    if args.is_moe and "experts" in config.lora.target_modules:
        # The adapters' rank-r products run beside the experts: backward's kernels give A's and
        # B's gradients, none the frozen experts' (megablox's whole-weight tgmm of a folded
        # adapter), and A's with its input dim minor, not the rank, which TPU tiles pad to 128
        # lanes.
        mesh, r = trainer.plan.mesh.shape, config.lora.rank
        e, d, f = args.num_experts // mesh["ep"], args.dim, args.moe_inter_dim // mesh["tp"]
        hlo = compiled.as_text()
        expert_sized = re.compile(rf"\[{e},({d},{f}|{f},{d})\]\S* custom-call\(")
        assert not expert_sized.search(hlo)
        rank_minor = re.compile(rf"\[{e},({d}|{f}),{r}\]{{2,\S* custom-call\(")  # layout {2,..}
        assert not rank_minor.search(hlo)
