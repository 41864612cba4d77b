"""A LoRA base stored below fp32 (`lora.base_dtype`): bf16, and QLoRA's int8, fp8 and nf4
(`models/frozen_base.py`). The base is stored as asked, leaves every step bitwise as it came,
equals qwix's quantize/dequantize of the HF weights, trains (sharded as one device; a resumed
QLoRA run: tests/train/test_lora_training.py), and the compiled step holds less for it; bad
keys are refused in one line."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from hf_fixtures import random_hf_model
from tiny_model import TINY

from titan_jax.config import ConfigError
from titan_jax.models.frozen_base import (
    CODES,
    NF4_VALUES,
    SCALE,
    FrozenBase,
    dequantize,
    is_quantized,
)
from titan_jax.train import loop
from titan_jax.train.start import load_start
from titan_jax.train.trainer import build_trainer
from titan_jax.trees import named_leaves, split_by_name

from test_lora_training import (  # isort: skip
    LORA,
    lora_losses,
    make_config,
    state_and_temp_bytes,
    two_steps_leave_the_base,
)

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

# TINY's head_dim (8) is wo's last input dim: nf4 blocks of 8 tile every weight.
NF4 = ("--lora.base_dtype", "nf4", "--lora.base_block_size", "8")
STORED = {"bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "nf4": jnp.uint8}
MOE = dataclasses.replace(TINY, num_experts=8, top_k=2, moe_inter_dim=16)


def base_leaves(trainer, params):
    """{name: leaf} of the frozen base, quantized weights as their {qvalue, scale} dicts."""
    return named_leaves(
        split_by_name(params, trainer.plan.model.trainable)[1], is_leaf=is_quantized
    )


def test_nf4_code_book_is_qwixs():
    from qwix._src.core.numerics import get_nf4_buckets

    np.testing.assert_array_equal(np.float32(NF4_VALUES), get_nf4_buckets())


@pytest.mark.slow
def test_qlora_nf4_fine_tunes_a_hf_base_quantized_as_qwix_quantizes_it(tmp_path):
    """A HF model's weights quantized at load (each projection's dequantized codes equal
    qwix's quantize/dequantize of the HF tensor, in HF's (out, in) layout), fresh adapters,
    one text learnt over FSDP 2; the base leaves training bitwise."""
    try:
        import transformers  # noqa: F401 (random_hf_model's)
    except ImportError as e:  # the `parity` extra; CI installs it
        if os.environ.get("CI"):
            raise
        pytest.skip(f"needs the parity extra: {e}")
    model = random_hf_model(TINY)
    model.save_pretrained(tmp_path / "hf")
    text = tmp_path / "fox.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 300)
    config = make_config(
        tmp_path / "run",
        *LORA,
        *NF4,
        "--training.dataset",
        "text",
        "--training.dataset_path",
        str(text),
        "--checkpoint.initial_load_path",
        str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf",
        "true",
    )
    devices = jax.devices()[:2]
    trainer = build_trainer(config, devices, model_args=TINY)
    first = jax.device_get(load_start(trainer, None).state)
    base = base_leaves(trainer, first["params"])

    hf_q = model.model.layers[1].self_attn.q_proj.weight.detach().numpy()  # (N*H, D)
    want = qwix.dequantize(
        qwix.quantize(jnp.asarray(hf_q), "nf4", channelwise_axes=(0,), tiled_axes={1: 8})
    )
    wq = base["layers.attention.wq"]
    got = dequantize(wq[CODES][1], wq[SCALE][1], FrozenBase("nf4", 8))  # (D, N, H)
    np.testing.assert_array_equal(np.asarray(got).reshape(TINY.dim, -1).T, want)
    assert wq[CODES].dtype == jnp.uint8 and wq[CODES].shape == (2, 32, 4, 4)  # 2 codes a byte
    assert base["tok_embeddings"].dtype == jnp.bfloat16  # QLoRA leaves them bf16

    result = loop.train(config, devices, model_args=TINY)
    losses = list(result.losses.values())
    assert len(losses) == 16 and np.mean(losses[-4:]) < losses[0] - 0.3, losses
    last = base_leaves(trainer, jax.device_get(result.state["params"]))
    jax.tree.map(np.testing.assert_array_equal, last, base)


@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8", "fp8"])
def test_a_narrowed_base_is_stored_as_asked_and_left_bitwise(tmp_path, base_dtype):
    config = make_config(tmp_path, *LORA, "--lora.base_dtype", base_dtype)
    trainer = build_trainer(config, jax.devices()[:1], model_args=TINY)
    first, last, adapters = two_steps_leave_the_base(trainer, TINY)
    base = base_leaves(trainer, first["params"])
    wo = base["layers.attention.wo"]
    assert (wo if base_dtype == "bfloat16" else wo[CODES]).dtype == STORED[base_dtype]
    assert base["layers.ffn_norm.weight"].dtype == jnp.bfloat16
    assert all(b.any() for n, b in named_leaves(adapters).items() if n.endswith("lora_b"))


def test_experts_are_quantized_and_train_their_adapters(tmp_path):
    """int8 experts: one scale per (layer, expert, output channel)."""
    config = make_config(
        tmp_path,
        *LORA[:4],
        "--lora.target_modules",
        "attention,experts",
        "--lora.base_dtype",
        "int8",
    )
    trainer = build_trainer(config, jax.devices()[:1], model_args=MOE)
    first, _, adapters = two_steps_leave_the_base(trainer, MOE)
    w1 = base_leaves(trainer, first["params"])["layers.moe.w1"]
    assert w1[CODES].dtype == jnp.int8 and w1[SCALE].shape == (2, 8, 1, 16)
    assert np.abs(adapters["layers"]["moe"]["w2_lora"]["lora_b"]).max() > 0


@pytest.mark.parametrize(
    "overrides",
    [
        ("--parallelism.data_parallel_shard_degree", "8"),  # the jit path
        (
            "--parallelism.data_parallel_shard_degree",
            "8",
            "--parallelism.fsdp_implementation",
            "shard_map",
        ),  # the explicit twin
    ],
)
def test_nf4_losses_are_one_devices_under_fsdp8(tmp_path, overrides):
    # blocks of 4: wq's 8 blocks of its input dim (32) split over 8 shards
    lora = (*LORA, "--lora.base_dtype", "nf4", "--lora.base_block_size", "4")
    sharded = lora_losses(
        tmp_path, 8, "--training.local_batch_size", "1", *overrides, lora=lora, batch=8, steps=2
    )
    one = lora_losses(tmp_path, 1, "--training.local_batch_size", "8", lora=lora, batch=8, steps=2)
    np.testing.assert_allclose(sharded, one, rtol=1e-5)


def test_the_step_holds_less_for_a_narrower_base(tmp_path):
    """State bytes of the compiled step: full fine-tuning > LoRA over an fp32 base > bf16 >
    int8 > nf4 (its embedding stays bf16)."""
    state = {
        name: state_and_temp_bytes(make_config(tmp_path, *overrides))[0]
        for name, overrides in [
            ("full", ()),
            ("float32", LORA),
            *((d, (*LORA, "--lora.base_dtype", d)) for d in ("bfloat16", "int8")),
            ("nf4", (*LORA, *NF4)),
        ]
    }
    assert list(state.values()) == sorted(state.values(), reverse=True), state
    assert state["int8"] < state["float32"] * 0.55, state


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("--lora.base_dtype", "int8"), "lora.base_dtype='int8' has no effect with lora.rank=0"),
        (
            (*LORA, "--lora.base_block_size", "32"),
            "lora.base_block_size=32 has no effect with lora.base_dtype=auto",
        ),
        (
            (*LORA, "--lora.base_dtype", "nf4", "--lora.base_block_size", "0"),
            "lora.base_block_size=0 must be >= 1",
        ),
        ((*LORA, "--lora.base_dtype", "int4"), "lora.base_dtype"),
    ],
)
def test_bad_base_keys_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match="^[^\n]*$") as e:
        make_config(tmp_path, *overrides)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("block", "n_devices", "message"),
    [
        # wo's last input dim (head_dim 8) is no multiple of 16
        (
            "16",
            1,
            "lora.base_block_size=16 does not divide the input dim (8) of "
            "layers.attention.wo; use lora.base_block_size=8",
        ),
        # wq's 4 blocks of its input dim (32) over fsdp 8
        (
            "8",
            8,
            "lora.base_block_size=8: the 4 nf4 blocks of layers.attention.wk's input dim "
            "(32) do not split over its 8 shards; use lora.base_block_size=4",
        ),
    ],
)
def test_nf4_blocks_that_do_not_fit_are_refused_with_one_that_does(
    tmp_path, block, n_devices, message
):
    config = make_config(
        tmp_path,
        *LORA,
        "--lora.base_dtype",
        "nf4",
        "--lora.base_block_size",
        block,
        "--parallelism.data_parallel_shard_degree",
        str(n_devices),
    )
    with pytest.raises(ConfigError, match="^[^\n]*$") as e:
        build_trainer(config, jax.devices()[:n_devices], model_args=TINY)
    assert message in str(e.value)
