"""The step's program does not grow with depth, which is why compiling Qwen3-0.6B's 28 layers
costs about what 8 cost (benchmarks/compile_time.py,
docs/notes/2026-12-01-compile-time.md)."""

import dataclasses
import re

import jax
import pytest
from tiny_model import TINY

from titan_jax.config import load_config
from titan_jax.planner import inspect_step
from titan_jax.train.trainer import build_trainer


def lowered_step_text(n_layers: int, ac: str) -> str:
    config = load_config(
        None,
        [
            "--training.local_batch_size",
            "2",
            "--training.seq_len",
            "8",
            "--activation_checkpoint.mode",
            ac,
        ],
    )
    args = dataclasses.replace(TINY, n_layers=n_layers)
    trainer = build_trainer(config, jax.devices()[:1], model_args=args)
    batch = inspect_step.abstract_batch(trainer)
    return trainer.lower_step(trainer.abstract_state(), batch).as_text()


@pytest.mark.parametrize("ac", ["none", "selective"])
def test_layers_are_one_loop_body_so_the_step_does_not_grow_with_depth(ac):
    """2 vs 8 layers: the same while loops (forward and backward scans over the layers) and
    nearly the same StableHLO text; only the stacked dims in the types differ. An unrolled
    layer loop would grow the text about fourfold."""
    shallow, deep = lowered_step_text(2, ac), lowered_step_text(8, ac)
    loops = re.compile(r"stablehlo\.while")
    assert len(loops.findall(deep)) == len(loops.findall(shallow)) >= 2
    assert abs(len(deep) - len(shallow)) < 0.01 * len(shallow), (len(shallow), len(deep))
