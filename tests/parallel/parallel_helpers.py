"""A tiny Qwen3, its data and the mesh presets, shared by the parallelism tests."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest

from titan_jax.config import JobConfig, load_config
from titan_jax.models.qwen3 import Qwen3Args
from titan_jax.train.loss import IGNORE_INDEX
from titan_jax.train.trainer import Trainer, build_trainer

# 8 heads / 4 kv heads so that tensor parallelism up to 4 divides both.
TINY = Qwen3Args(
    dim=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=4,
    head_dim=8,
    hidden_dim=128,
    vocab_size=256,
    max_seq_len=64,
)
SEQ_LEN = 16
GLOBAL_BATCH = 8

# The mesh presets of the issue, on 8 devices: name -> (dp_replicate, fsdp, tp).
PRESETS = {
    "ddp8": (8, 1, 1),
    "fsdp8": (1, 8, 1),
    "hsdp2x4": (2, 4, 1),
    "fsdp4_tp2": (1, 4, 2),
    "fsdp2_tp4": (1, 2, 4),
}


def preset_overrides(name: str) -> list[str]:
    """Parallelism flags of preset `name`, with the local batch that keeps GLOBAL_BATCH."""
    replicate, shard, tp = PRESETS[name]
    return [
        "--parallelism.data_parallel_replicate_degree",
        str(replicate),
        "--parallelism.data_parallel_shard_degree",
        str(shard),
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--training.local_batch_size",
        str(GLOBAL_BATCH // (replicate * shard)),
    ]


def tiny_config(*overrides: str) -> JobConfig:
    """fp32 unless overridden; a short warmup and a high LR so 20 steps move the weights."""
    return load_config(
        None,
        [
            "--training.seq_len",
            str(SEQ_LEN),
            "--training.steps",
            "20",
            "--training.mixed_precision_param",
            "float32",
            "--optimizer.lr",
            "3e-3",
            "--lr_scheduler.warmup_steps",
            "2",
            "--training.global_batch_size",
            str(GLOBAL_BATCH),
            *overrides,
        ],
    )


def tiny_trainer(*overrides: str, n_devices: int = 8) -> Trainer:
    return build_trainer(tiny_config(*overrides), jax.devices()[:n_devices], model_args=TINY)


def single_device_overrides() -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH)]


def make_batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Learnable data (arithmetic sequences mod vocab), with some ignored labels so that the
    valid-token count differs between data-parallel ranks."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, TINY.vocab_size, (GLOBAL_BATCH, 1))
        stride = rng.integers(1, 5, (GLOBAL_BATCH, 1))
        tokens = ((start + stride * np.arange(SEQ_LEN + 1)) % TINY.vocab_size).astype(np.int32)
        labels = tokens[:, 1:].copy()
        labels[0, :5] = IGNORE_INDEX
        out.append({"inputs": tokens[:, :-1], "labels": labels})
    return out


def run_losses(
    trainer: Trainer, host_state: object, batches: list[dict[str, np.ndarray]]
) -> np.ndarray:
    state = jax.device_put(host_state, trainer.state_shardings)
    losses = []
    for batch in batches:
        state, metrics = trainer.step_fn(state, trainer.batches.put(batch))
        losses.append(metrics["loss"])
    return np.array([float(x) for x in losses])


# The shipped recipes' TPU compiles (test_*recipe*_aot.py, test_qlora_aot.py): libtpu needed,
# minutes of compile, at XLA's lowest execution-time effort (tests/conftest.py).
RECIPE_AOT_MARKS = [
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
    ),
    pytest.mark.slow,
    pytest.mark.usefixtures("least_compile_effort"),
]
