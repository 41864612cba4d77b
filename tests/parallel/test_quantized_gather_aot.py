"""The 8B recipe with quantized matmuls compiles for TPU ahead of time on this CPU with
libtpu, its FSDP gathers moving the weights' one-byte codes (`quantize.gather = "auto"`):
f8e4m3fn on Ironwood (fp8, tpu7x-8) and s8 on v6e (int8, v6e-8); quantizing after the gather
(`param_dtype`) moves bf16. What the estimate prices is these gathers' bytes
(`planner/collectives.py` reads them from the compiled program).

Layers are cut to 2 (what fails to compile fails at any depth); the full-depth rows are in
docs/TPU.md (`make plans`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections import Counter

import pytest

from titan_jax.config import load_config
from titan_jax.models.qwen3 import get_flavor
from titan_jax.planner import inspect_step
from titan_jax.planner.topology import compile_only_devices, parse_slice
from titan_jax.train.trainer import build_trainer

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
    ),
    pytest.mark.slow,
]

# An all-gather's result: its element type and shape (async ones as their `-start`).
_GATHER = re.compile(r"= \(?(\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(")


def gathered_weights(topology: str, mode: str, gather: str) -> Counter:
    """Element types of the all-gathers of one layer's projection weights (the 8B's 4096-wide
    ones) in the compiled 8B-at-2-layers step, counted."""
    config = load_config(
        "configs/qwen3_8b.toml", ["--quantize.mode", mode, "--quantize.gather", gather]
    )
    args = dataclasses.replace(get_flavor(config.model.flavor), n_layers=2)
    trainer = build_trainer(config, compile_only_devices(parse_slice(topology)), model_args=args)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    found = Counter()
    for dtype, shape in _GATHER.findall(lowered.compile().as_text()):
        dims = [int(d) for d in shape.split(",") if d]
        if "4096" in shape.split(",") and len(dims) >= 2 and min(dims[-2:]) >= 128:
            found[dtype] += 1
    return found


@pytest.mark.parametrize(
    "topology, mode, code", [("tpu7x-8", "fp8", "f8e4m3fn"), ("v6e-8", "int8", "s8")]
)
def test_8b_weights_are_gathered_as_one_byte_codes(topology, mode, code):
    gathered = gathered_weights(topology, mode, "auto")
    # Every projection weight (q, k, v, o, w1, w2, w3), forward and remat's re-gather.
    assert gathered[code] >= 7, gathered
    assert not gathered["bf16"], gathered
    assert gathered_weights(topology, mode, "param_dtype")["bf16"] >= 7  # the check can fail
