"""The 8B QLoRA recipe (configs/qwen3_8b_qlora.toml: nf4, and int8) compiles for a v5e-4 slice
ahead of time on this CPU with libtpu, FSDP over its 4 chips: the frozen base is all-gathered
in its stored dtype (int8 codes, nf4 codes two to a byte) and holds less per chip as it
narrows (a bf16 base: docs/POSTTRAINING.md).

Layers are cut to 2 (what fails to compile fails at any depth); the full-depth figures
(`titan-jax compile`) are in docs/notes/2026-12-06-lora-memory.md.
"""

from __future__ import annotations

import dataclasses
import re

from parallel_helpers import RECIPE_AOT_MARKS

from titan_jax.config import load_config
from titan_jax.models.qwen3 import get_flavor
from titan_jax.planner import inspect_step
from titan_jax.planner.topology import compile_only_devices, parse_slice
from titan_jax.train.trainer import build_trainer

pytestmark = RECIPE_AOT_MARKS

# The HLO element type each base is gathered in.
GATHERED = {"int8": "s8", "nf4": "u8"}


RECIPES = {"configs/qwen3_8b_qlora.toml": "v5e-4"}  # recipe -> the slice it is planned on


def compile_8b(base_dtype: str):
    [(recipe, topology)] = RECIPES.items()
    config = load_config(recipe, ["--lora.base_dtype", base_dtype])
    args = dataclasses.replace(get_flavor(config.model.flavor), n_layers=2)
    trainer = build_trainer(config, compile_only_devices(parse_slice(topology)), model_args=args)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    return trainer, lowered.compile()


def test_8b_qlora_compiles_for_v5e4_gathered_as_stored():
    arguments = {}
    for base_dtype, element in GATHERED.items():
        trainer, compiled = compile_8b(base_dtype)
        assert trainer.plan.mesh.shape["fsdp"] == 4
        memory = compiled.memory_analysis()
        assert memory.peak_memory_in_bytes < 15.75 * 2**30, (base_dtype, memory)  # v5e's usable
        arguments[base_dtype] = memory.argument_size_in_bytes
        # wq's codes (4096 x 32 x 128 per layer; nf4: 64 bytes of two codes along head_dim)
        last = 64 if base_dtype == "nf4" else 128
        wq = re.compile(rf"{element}\[(1,)?4096,32,{last}\]")  # (one layer of the scan)
        gathers = [
            line
            for line in compiled.as_text().splitlines()
            if "all-gather" in line and wq.search(line)
        ]
        assert gathers, base_dtype
    assert arguments["int8"] > arguments["nf4"], arguments
