"""Training with fp8 and int8 matmuls (`[quantize]`, emulated on CPU devices) learns like bf16:
the debug recipe's model (cut to 2 layers) and a small MoE, under the recipe's settings, end
within 2% of the bf16 run's loss; the shipped recipe trains in fp8 through the CLI; chips
without the mode's fast path are refused in one line."""

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_args import QUIET_METRICS

from titan_jax.cli import main
from titan_jax.config import ConfigError, load_config
from titan_jax.models.qwen3 import QWEN3_FLAVORS, Qwen3Args
from titan_jax.train import loop
from titan_jax.train.plan_decisions import resolve_quantization

SMALL = Qwen3Args(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    hidden_dim=128,
    vocab_size=2048,
    max_seq_len=64,
)
SMALL_MOE = dataclasses.replace(SMALL, num_experts=4, top_k=2, moe_inter_dim=64)
# The debug recipe's model at its every dim (256 wide, head_dim 128, ffn 3072), 2 layers.
DEBUG_2_LAYERS = dataclasses.replace(QWEN3_FLAVORS["debugmodel"], n_layers=2)
RECIPE = "configs/qwen3_debug.toml"
STEPS = 40


def final_loss(tmp_path, args, mode, modules="attention,mlp,experts"):
    """The mean loss of the last 15 of 40 steps of the debug recipe's settings (its remat
    mode, batch, schedule) with bf16 weights and activations."""
    config = load_config(
        RECIPE,
        [
            "--job.dump_folder",
            str(tmp_path / f"{args.is_moe}-{mode}"),
            "--training.steps",
            str(STEPS),
            "--training.seed",
            "0",
            "--training.mixed_precision_param",
            "bfloat16",
            "--metrics.log_freq",
            "1",
            *QUIET_METRICS,
            "--checkpoint.enable",
            "false",
            "--validation.enable",
            "false",
            "--quantize.mode",
            mode,
            "--quantize.modules",
            modules,
        ],
    )
    losses = loop.train(config, jax.devices()[:1], model_args=args).losses
    assert len(losses) == STEPS and all(np.isfinite(list(losses.values()))), losses
    return float(np.mean([losses[s] for s in range(STEPS - 14, STEPS + 1)]))


@pytest.mark.slow
def test_fp8_and_int8_runs_end_within_2_percent_of_bf16(tmp_path):
    gaps = {}
    for args in (DEBUG_2_LAYERS, SMALL_MOE):
        bf16 = final_loss(tmp_path, args, "none")
        for mode in ("fp8", "int8"):
            gaps[mode, args.is_moe] = final_loss(tmp_path, args, mode) / bf16 - 1
    print({k: f"{v:+.2%}" for k, v in gaps.items()})
    assert all(abs(gap) < 0.02 for gap in gaps.values()), gaps


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        (),  # the recipe as shipped: fp32 weights, rowwise, no remat, attention and MLP
        (
            "--training.mixed_precision_param",
            "bfloat16",
            "--quantize.scaling",
            "tensorwise",
            "--activation_checkpoint.mode",
            "selective",
            "--quantize.modules",
            "mlp",
        ),
    ],
    ids=["as-shipped", "bf16-tensorwise-selective-mlp"],
)
def test_fp8_trains_the_debug_recipe_under_every_remat_mode(tmp_path, capsys, monkeypatch, options):
    """What a new user types: every step finite and applied, and the loss falls. (Without
    models/quantization.py's reduce_precision lowering every step was NaN under the recipe's
    remat mode, "none".)"""
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])
    code = main(
        [
            "train",
            "--config",
            RECIPE,
            "--quantize.mode",
            "fp8",
            *options,
            "--training.local_batch_size",
            "4",
            "--training.steps",
            "5",
            "--lr_scheduler.warmup_steps",
            "2",
            "--metrics.log_freq",
            "1",
            *QUIET_METRICS,
            "--checkpoint.enable",
            "false",
            "--validation.enable",
            "false",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "non-finite" not in out.out + out.err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    # Each step draws other text (+-0.3): falling means well below the first, once.
    assert len(losses) == 5 and all(np.isfinite(losses)), losses
    assert min(losses[2:]) < losses[0] - 0.2, losses


def test_an_fp8_value_reduced_to_its_own_format_is_unchanged():
    """e4m3fn's top binade [256, 448] survives the rounding jax's remat puts on saved fp8
    residuals; other formats are still rounded."""
    values = jnp.array([1.0, 240.0, 256.0, 448.0, -448.0])
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        x = values.astype(dtype)
        info = jnp.finfo(dtype)
        same = jax.jit(
            lambda x, info=info: jax.lax.reduce_precision(
                x, exponent_bits=info.nexp, mantissa_bits=info.nmant
            )
        )(x)
        np.testing.assert_array_equal(np.asarray(same, np.float32), np.asarray(x, np.float32))
    rounded = jax.lax.reduce_precision(jnp.array([1.001, 3e5]), exponent_bits=5, mantissa_bits=2)
    np.testing.assert_array_equal(np.asarray(rounded), [1.0, np.inf])


def _device(platform, kind, **extra):
    return SimpleNamespace(platform=platform, device_kind=kind, **extra)


@pytest.mark.parametrize(
    "mode,device,hint",
    [
        ("fp8", _device("tpu", "TPU v5 lite"), "use quantize.mode=int8"),
        ("fp8", _device("tpu", "TPU v6 lite"), "use quantize.mode=int8"),
        ("int8", _device("tpu", "TPU7x"), "use quantize.mode=fp8"),
        ("int8", _device("gpu", "NVIDIA H200", compute_capability="9.0"), "use quantize.mode=fp8"),
        ("fp8", _device("gpu", "NVIDIA A100", compute_capability="8.0"), "use quantize.mode=none"),
    ],
)
def test_a_chip_without_the_modes_fast_path_is_refused_naming_one_that_works(mode, device, hint):
    config = load_config(None, ["--quantize.mode", mode])
    degrees = SimpleNamespace(cp=1, tp=1)
    with pytest.raises(ConfigError, match=f"{device.device_kind} has no {mode}.*{hint}"):
        resolve_quantization(config, SMALL, degrees, [device])
    other = load_config(None, ["--quantize.mode", hint.rpartition("=")[2]])
    assert resolve_quantization(other, SMALL, degrees, [device]).mode == other.quantize.mode


def test_what_the_chips_take():
    degrees = SimpleNamespace(cp=1, tp=1)
    for mode, device in [
        ("fp8", _device("tpu", "TPU7x")),
        ("int8", _device("tpu", "TPU v5")),
        ("int8", _device("tpu", "TPU v6 lite")),
        ("fp8", _device("gpu", "NVIDIA H100", compute_capability="9.0")),
    ]:
        config = load_config(None, ["--quantize.mode", mode])
        q = resolve_quantization(config, SMALL, degrees, [device])
        assert q.mode == mode and q.modules == ("attention", "mlp")  # dense: no experts


def test_tensorwise_scales_are_refused_for_experts_only_where_there_are_experts():
    degrees = SimpleNamespace(cp=1, tp=1)
    cpu = [_device("cpu", "cpu")]
    config = load_config(None, ["--quantize.mode", "int8", "--quantize.scaling", "tensorwise"])
    assert resolve_quantization(config, SMALL, degrees, cpu).modules == ("attention", "mlp")
    with pytest.raises(ConfigError, match="experts' grouped matmuls take rowwise scales only"):
        resolve_quantization(config, SMALL_MOE, degrees, cpu)


def test_small_experts_on_tpu_and_blocks_that_do_not_divide_are_refused():
    degrees = SimpleNamespace(cp=1, tp=1)
    tpu = [_device("tpu", "TPU v5")]
    with pytest.raises(ConfigError, match="needs a model dim of at least 128, not 64"):
        resolve_quantization(
            load_config(None, ["--quantize.mode", "int8"]), SMALL_MOE, degrees, tpu
        )
    config = load_config(None, ["--quantize.mode", "int8", "--quantize.modules", "attention"])
    assert resolve_quantization(config, SMALL_MOE, degrees, tpu).modules == ("attention",)
    wide = dataclasses.replace(SMALL_MOE, dim=256, moe_inter_dim=256)
    config = load_config(None, ["--quantize.mode", "int8"])
    assert resolve_quantization(config, wide, degrees, tpu).modules == (
        "attention",
        "mlp",
        "experts",
    )
    with pytest.raises(ConfigError, match="expert hidden dim per tensor-parallel rank"):
        resolve_quantization(config, wide, SimpleNamespace(cp=1, tp=4), tpu)
    short = load_config(
        None,
        ["--quantize.mode", "int8", "--training.local_batch_size", "1", "--training.seq_len", "32"],
    )
    with pytest.raises(ConfigError, match=r"number of expert rows per device .* not 64"):
        resolve_quantization(short, wide, degrees, tpu)
    config = load_config(
        None,
        [
            "--quantize.mode",
            "int8",
            "--quantize.modules",
            "mlp",
            "--quantize.scaling",
            "blockwise",
            "--quantize.block_size",
            "48",
        ],
    )
    with pytest.raises(ConfigError, match=r"block_size=48 must divide the model dim \(64\)"):
        resolve_quantization(config, SMALL, degrees, tpu)
