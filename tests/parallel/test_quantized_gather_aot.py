"""The 8B recipe with quantized matmuls compiles for TPU ahead of time on this CPU with
libtpu, its FSDP gathers moving the weights' one-byte codes (`quantize.gather = "auto"`):
f8e4m3fn on Ironwood (fp8, tpu7x-8) and s8 on v6e (int8, v6e-8), where quantizing after the
gather (`param_dtype`) moves bf16. What the estimate prices is these gathers' bytes
(`planner/collectives.py` reads them from the compiled program). Each compile takes minutes
here.

Layers are cut to 2 (what fails to compile fails at any depth); the full-depth rows are in
docs/TPU.md (`make plans`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
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

# The 8B's projection weights as one layer's matmuls read them (wq, wk/wv, wo, w1/w3, w2).
PROJECTIONS = {(4096, 32, 128), (4096, 8, 128), (32, 128, 4096), (4096, 12288), (12288, 4096)}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def gathered_weights(topology: str, mode: str) -> Counter:
    """Element types of the all-gathers of projection weights in the compiled 8B-at-2-layers
    step, counted (an async gather's result: the largest array its `-start` returns)."""
    config = load_config("configs/qwen3_8b.toml", ["--quantize.mode", mode])
    args = dataclasses.replace(get_flavor(config.model.flavor), n_layers=2)
    trainer = build_trainer(config, compile_only_devices(parse_slice(topology)), model_args=args)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    found = Counter()
    for line in lowered.compile().as_text().splitlines():
        head, gather, _ = line.partition(" all-gather")
        if not gather or "=" not in head:
            continue
        arrays = [
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(head.split("=", 1)[1])
        ]
        dtype, shape = max(arrays, key=lambda a: math.prod(a[1]))
        if shape[1:] in PROJECTIONS or shape in PROJECTIONS:  # with or without a layer dim
            found[dtype] += 1
    return found


@pytest.mark.parametrize(
    "topology, mode, code", [("tpu7x-8", "fp8", "f8e4m3fn"), ("v6e-8", "int8", "s8")]
)
def test_8b_weights_are_gathered_as_one_byte_codes(topology, mode, code):
    """Quantizing after the gather (`quantize.gather = "param_dtype"`, the path before issue
    44) gathers these weights in bf16."""
    gathered = gathered_weights(topology, mode)
    assert set(gathered) == {code} and gathered[code] >= 7, gathered  # every projection
