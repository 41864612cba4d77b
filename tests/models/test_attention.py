"""Attention backends (`model.attention`): splash (run by Pallas' interpreter on CPU) and cuDNN's
arguments equal the xla path; the choice follows the target platform; a whole train step with
splash gives the xla path's losses on one device and under both SimpleFSDP implementations."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from titan_jax.config import ConfigError, load_config
from titan_jax.models import BuildOptions
from titan_jax.models.attention import (
    causal_gqa_attention,
    cudnn_attention,
    resolve_attention,
    splash_attention,
    splash_block,
)
from titan_jax.models.qwen3 import Qwen3Args
from titan_jax.models.qwen3.build import build_model_def
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

# GQA 2 (8 query heads on 4 kv heads) so that tensor parallelism 2 splits both; splash tiles
# sequences in multiples of 128 rows.
ARGS = Qwen3Args(
    dim=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=4,
    head_dim=8,
    hidden_dim=128,
    vocab_size=256,
    max_seq_len=256,
)
SEQ, BATCH = 256, 8


def qkv(b: int, t: int, n: int, kv: int, h: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(keys[0], (b, t, n, h)),
        jax.random.normal(keys[1], (b, t, kv, h)),
        jax.random.normal(keys[2], (b, t, kv, h)),
    )


def max_rel(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def test_splash_equals_xla_path_forward_and_gradients():
    """GQA 4 -> 2 kv heads, 3 blocks of 128 per sequence (the causal mask's partial and skipped
    blocks), fp32: outputs and the gradients of q, k, v within 2e-6 of the plain path."""
    q, k, v = qkv(2, 384, 4, 2, 16)
    scale = 16**-0.5
    splash = jax.jit(lambda q, k, v: splash_attention(q, k, v, scale, interpret=True))
    xla = jax.jit(lambda q, k, v: causal_gqa_attention(q, k, v, scale))
    assert max_rel(splash(q, k, v), xla(q, k, v)) < 2e-6

    def grads(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(q, k, v)

    for got, want in zip(grads(splash), grads(xla), strict=True):
        assert max_rel(got, want) < 2e-6


def test_cudnn_call_has_the_xla_paths_layout_scale_and_mask():
    """The cuDNN call itself needs a GPU; the same `dot_product_attention` arguments with
    XLA's implementation give our path's output, GQA included."""
    q, k, v = qkv(2, 32, 4, 2, 16)
    got = cudnn_attention(q, k, v, 0.3, implementation="xla")
    assert max_rel(got, causal_gqa_attention(q, k, v, 0.3)) < 1e-6


def test_auto_follows_the_target_platform():
    assert resolve_attention("auto", "cpu") == "xla"
    assert resolve_attention("auto", "tpu", jnp.bfloat16, {"training.seq_len": 4096}) == "splash"
    assert resolve_attention("auto", "gpu", jnp.bfloat16) == "cudnn"
    # What cannot run falls back instead of failing: fp32 on GPU, untiled lengths on TPU.
    assert resolve_attention("auto", "gpu", jnp.float32) == "xla"
    assert resolve_attention("auto", "tpu", jnp.bfloat16, {"training.seq_len": 100}) == "xla"
    assert resolve_attention("splash", "cpu") == "splash"  # interpreted: tests, debugging


def test_a_gpu_target_builds_the_cudnn_kernel_into_the_model():
    model_def = build_model_def(ARGS, BuildOptions(platform="gpu"))
    model = nnx.merge(model_def.graphdef, model_def.init(jax.random.key(0)))
    assert model.layers.attention.backend == "cudnn"
    model_def = build_model_def(ARGS, BuildOptions(platform="gpu", attention="xla"))
    assert (
        nnx.merge(model_def.graphdef, model_def.init(jax.random.key(0))).layers.attention.backend
        == "xla"
    )


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="model.attention='flash'.*auto, xla, splash, cudnn"):
        load_config(None, ["--model.attention", "flash"])


@pytest.mark.parametrize(
    "choice, platform, dtype, hint",
    [
        ("cudnn", "cpu", None, "model.attention=cudnn needs GPU devices"),
        ("cudnn", "gpu", jnp.float32, "training.mixed_precision_param=bfloat16"),
        ("splash", "gpu", None, "model.attention=splash is a TPU kernel"),
    ],
)
def test_backends_that_cannot_run_say_what_would(choice, platform, dtype, hint):
    with pytest.raises(ConfigError, match=hint):
        resolve_attention(choice, platform, dtype)
    if dtype is not None:  # the hint works
        assert resolve_attention(choice, platform, jnp.bfloat16) == choice


def test_splash_needs_tiled_sequence_lengths():
    with pytest.raises(
        ConfigError,
        match=r"training.seq_len=1000 must be a multiple of 128 .*"
        r"use e.g. 896, or model.attention=xla",
    ):
        resolve_attention("splash", "tpu", None, {"training.seq_len": 1000})
    with pytest.raises(ConfigError, match=r"validation.seq_len=100 .*use e.g. 128"):
        resolve_attention(
            "splash", "tpu", None, {"training.seq_len": 128, "validation.seq_len": 100}
        )
    assert resolve_attention("splash", "tpu", None, {"training.seq_len": 896}) == "splash"
    assert [splash_block(n) for n in (128, 384, 512, 1536, 32768)] == [128, 128, 512, 512, 512]


def test_trainer_rejects_an_untiled_seq_len_for_splash():
    config = load_config(None, ["--model.attention", "splash", "--training.seq_len", "200"])
    with pytest.raises(ConfigError, match="training.seq_len=200 must be a multiple of 128"):
        build_trainer(config, jax.devices()[:1], model_args=ARGS)


def _losses(attention: str, n_devices: int, *overrides: str) -> np.ndarray:
    config = load_config(
        None,
        [
            "--model.attention",
            attention,
            "--training.seq_len",
            str(SEQ),
            "--training.mixed_precision_param",
            "float32",
            "--optimizer.lr",
            "3e-3",
            "--lr_scheduler.warmup_steps",
            "1",
            "--training.global_batch_size",
            str(BATCH),
            "--training.local_batch_size",
            str(BATCH),
            *overrides,
        ],
    )
    trainer = build_trainer(config, jax.devices()[:n_devices], model_args=ARGS)
    assert trainer.plan.model.options.attention == attention
    state = trainer.init_state()
    tokens = np.random.default_rng(0).integers(0, ARGS.vocab_size, (3, BATCH, SEQ + 1))
    losses = []
    for step_tokens in tokens.astype(np.int32):
        batch = {"inputs": step_tokens[:, :-1], "labels": step_tokens[:, 1:]}
        state, metrics = trainer.step_fn(state, trainer.batches.put(batch))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.fixture(scope="module")
def xla_losses() -> np.ndarray:
    return _losses("xla", 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "n_devices, overrides",
    [
        (1, ()),
        (
            8,
            (
                "--parallelism.data_parallel_shard_degree",
                "4",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--training.local_batch_size",
                "2",
                "--parallelism.fsdp_implementation",
                "jit",
            ),
        ),
        (
            8,
            (
                "--parallelism.data_parallel_shard_degree",
                "4",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--training.local_batch_size",
                "2",
                "--parallelism.fsdp_implementation",
                "shard_map",
            ),
        ),
    ],
    ids=["1_device", "fsdp4_tp2_jit", "fsdp4_tp2_shard_map"],
)
def test_train_steps_with_splash_match_the_xla_path(xla_losses, n_devices, overrides):
    """3 optimizer steps from one init: splash (one kernel per device under shard_map, heads
    split over tp) gives the single-device xla path's losses."""
    np.testing.assert_allclose(_losses("splash", n_devices, *overrides), xla_losses, rtol=2e-6)


def _temp_bytes(attention: str) -> int:
    from jax.experimental import topologies

    from titan_jax.planner import inspect_step

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    args = dataclasses.replace(ARGS, head_dim=128, max_seq_len=2048)
    config = load_config(
        None,
        [
            "--model.attention",
            attention,
            "--training.seq_len",
            "2048",
            "--training.local_batch_size",
            "1",
            "--training.mixed_precision_param",
            "bfloat16",
            "--activation_checkpoint.mode",
            "selective",
        ],
    )
    trainer = build_trainer(config, list(topology.devices), model_args=args)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.usefixtures("least_compile_effort")
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
)
def test_splash_step_on_v5p_needs_far_less_memory_than_materialised_scores(monkeypatch):
    """A v5p:2x2x2 step (FSDP 8, bf16, seq 2048, 8 heads of 128) compiled ahead of time: the
    kernel's per-device temporaries are a fraction of the xla path's (T^2 scores per head)."""
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    splash, xla = _temp_bytes("splash"), _temp_bytes("xla")
    assert splash < 0.5 * xla, (splash, xla)
