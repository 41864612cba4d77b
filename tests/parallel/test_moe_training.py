"""Qwen3-MoE trains through the same compiled step: equal losses and expert bias on every mesh,
and a resume that restores the bias bitwise."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from parallel_helpers import TINY, make_batches, preset_overrides, single_device_overrides
from parallel_helpers import tiny_config as base_config

from titan_jax.train.checkpoint import Checkpointer
from titan_jax.train.trainer import build_trainer

TINY_MOE = dataclasses.replace(TINY, num_experts=8, top_k=2, moe_inter_dim=32)
STEPS = 20


def tiny_config(*overrides: str):
    return base_config(
        "--training.steps", str(STEPS), "--moe.load_balance_coeff", "1e-2", *overrides
    )


def run(trainer, batches, state=None):
    state = trainer.init_state() if state is None else state
    losses, metrics = [], None
    for batch in batches:
        state, metrics = trainer.step_fn(state, trainer.batches.put(batch))
        losses.append(float(metrics["loss"]))
    return state, np.array(losses), metrics


@pytest.fixture(scope="module")
def reference():
    trainer = build_trainer(
        tiny_config(*single_device_overrides()), jax.devices()[:1], model_args=TINY_MOE
    )
    init = jax.device_get(trainer.init_state())
    # A sharper router than init's near-uniform one: with every probability ~1/8, rounding
    # differences between meshes (a reduction order) flip top-k near-ties and the runs part.
    init["params"]["layers"]["moe"]["gate"] = init["params"]["layers"]["moe"]["gate"] * 50
    state, losses, metrics = run(trainer, make_batches(STEPS), jax.device_put(init))
    assert losses[-1] < 0.95 * losses[0], "the tiny MoE must learn"
    bias = np.asarray(state["buffers"]["expert_bias"])
    assert np.abs(bias).max() > 0 and abs(bias.sum(-1)).max() < 1e-5  # moved, mean-centred
    assert 1 <= float(metrics["moe_max_load"]) and 0 <= float(metrics["moe_idle_experts"]) < 1
    return init, losses, bias


@pytest.mark.parametrize(
    "preset, implementation",
    [
        ("fsdp8", "jit"),
        ("fsdp8", "shard_map"),
        ("fsdp4_tp2", "jit"),
        pytest.param("hsdp2x4", "shard_map", marks=pytest.mark.slow),
    ],
)
def test_moe_losses_and_expert_bias_equal_one_device(reference, preset, implementation):
    init, want_losses, want_bias = reference
    trainer = build_trainer(
        tiny_config(*preset_overrides(preset), "--parallelism.fsdp_implementation", implementation),
        model_args=TINY_MOE,
    )
    state, losses, _ = run(
        trainer, make_batches(STEPS), jax.device_put(init, trainer.state_shardings)
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(state["buffers"]["expert_bias"], want_bias, atol=1e-7)


@pytest.mark.parametrize(
    "preset, ep, chunks",
    [  # ep2: experts' model dim over the fsdp
        ("fsdp8", 2, 1),
        ("fsdp8", 8, 1),
        ("fsdp8", 8, 2),  # rest; ep8: none
        pytest.param(
            "hsdp2x4",
            2,
            1,
            marks=[
                pytest.mark.slow,
                pytest.mark.xfail(
                    strict=False,
                    reason="on some CPUs (2026-12-02) a near-tie flips routing picks from "
                    "step 13: expert bias off by sign steps, losses by 3e-5; under investigation",
                ),
            ],
        ),
        pytest.param("fsdp4_tp2", 2, 1, marks=pytest.mark.slow),
    ],
)
def test_expert_parallel_losses_and_expert_bias_equal_one_device(reference, preset, ep, chunks):
    init, want_losses, want_bias = reference
    trainer = build_trainer(
        tiny_config(
            *preset_overrides(preset),
            "--parallelism.expert_parallel_degree",
            str(ep),
            "--parallelism.expert_parallel_chunks",
            str(chunks),
        ),
        model_args=TINY_MOE,
    )
    assert trainer.plan.degrees.ep == ep and trainer.parallelism.implementation == "shard_map"
    # Experts are split over ep; their model dim over what is left of the FSDP ranks.
    spec = (*trainer.state_shardings["params"]["layers"]["moe"]["w1"].spec, None, None)
    assert spec[1] == "ep" and (spec[2] == "fsdp") == (trainer.plan.degrees.fsdp > 1), spec
    state, losses, _ = run(
        trainer, make_batches(STEPS), jax.device_put(init, trainer.state_shardings)
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(state["buffers"]["expert_bias"], want_bias, atol=1e-7)


def test_lookahead_gather_with_expert_parallelism_trains_like_one_device(reference):
    """Each MoE layer's weights gathered a layer ahead (models/lookahead.py): the router's in
    fp32, as the router reads it, the experts' over the FSDP ranks ep2 leaves."""
    init, want_losses, want_bias = reference
    trainer = build_trainer(
        tiny_config(
            *preset_overrides("fsdp8"),
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
            "--parallelism.fsdp_lookahead_gather",
            "true",
        ),
        model_args=TINY_MOE,
    )
    assert trainer.plan.model.options.lookahead_gather
    state, losses, _ = run(
        trainer, make_batches(STEPS), jax.device_put(init, trainer.state_shardings)
    )
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(state["buffers"]["expert_bias"], want_bias, atol=1e-7)


@pytest.mark.parametrize(
    "overrides, args, message",
    [
        (("--parallelism.expert_parallel_degree", "2"), TINY, "applies to MoE flavours only"),
        (
            (
                "--parallelism.expert_parallel_degree",
                "8",
                "--parallelism.data_parallel_shard_degree",
                "8",
            ),
            dataclasses.replace(TINY_MOE, num_experts=4, top_k=2),
            "must divide the 4 experts",
        ),
        (("--parallelism.expert_parallel_degree", "3"), TINY_MOE, "must divide the data-parallel"),
        (
            (
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.fsdp_implementation",
                "jit",
            ),
            TINY_MOE,
            "fsdp_implementation=jit cannot host expert parallelism",
        ),
    ],
)
def test_expert_parallel_config_errors(overrides, args, message):
    from titan_jax.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_trainer(tiny_config(*preset_overrides("fsdp8"), *overrides), model_args=args)


def test_expert_parallel_chunks_that_do_not_divide_the_picks_are_refused_with_a_working_hint():
    from titan_jax.config import ConfigError

    ep = ("--parallelism.expert_parallel_degree", "2")
    with pytest.raises(ConfigError, match="expert_parallel_degree is 1"):
        build_trainer(
            tiny_config(*preset_overrides("fsdp8"), "--parallelism.expert_parallel_chunks", "2"),
            model_args=TINY_MOE,
        )
    with pytest.raises(ConfigError, match=r"must divide each device's 32 picks") as refused:
        build_trainer(
            tiny_config(
                *preset_overrides("fsdp8"), *ep, "--parallelism.expert_parallel_chunks", "3"
            ),
            model_args=TINY_MOE,
        )
    hint = str(refused.value).rsplit("use ", 1)[1]
    trainer = build_trainer(
        tiny_config(*preset_overrides("fsdp8"), *ep, "--parallelism.expert_parallel_chunks", hint),
        model_args=TINY_MOE,
    )
    assert trainer.parallelism.ep_chunks == int(hint) == 2
    # a validation batch's picks split the same way: 1 x 3 tokens x top_k 2; the hint divides
    # the training batch's 32 picks too (3 would divide the validation's 6 only)
    validation = (
        "--validation.enable",
        "true",
        "--validation.local_batch_size",
        "1",
        "--validation.seq_len",
        "3",
    )
    with pytest.raises(ConfigError, match="6 picks a validation batch") as refused:
        build_trainer(
            tiny_config(
                *preset_overrides("fsdp8"),
                *ep,
                *validation,
                "--parallelism.expert_parallel_chunks",
                "4",
            ),
            model_args=TINY_MOE,
        )
    hint = str(refused.value).rsplit("use ", 1)[1]
    build_trainer(
        tiny_config(
            *preset_overrides("fsdp8"),
            *ep,
            *validation,
            "--parallelism.expert_parallel_chunks",
            hint,
        ),
        model_args=TINY_MOE,
    )


def test_resume_restores_the_expert_bias_bitwise(reference, tmp_path):
    init, _, _ = reference
    trainer = build_trainer(tiny_config(*preset_overrides("fsdp8")), model_args=TINY_MOE)
    batches = make_batches(STEPS)
    whole, whole_losses, _ = run(trainer, batches, jax.device_put(init, trainer.state_shardings))
    half, _, _ = run(trainer, batches[:6], jax.device_put(init, trainer.state_shardings))
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(6, half, data_state={}, tokens_seen=0)
        restored = ckpt.restore(6, trainer.abstract_state()).state
    np.testing.assert_array_equal(
        restored["buffers"]["expert_bias"], half["buffers"]["expert_bias"]
    )
    resumed, resumed_losses, _ = run(trainer, batches[6:], restored)
    np.testing.assert_array_equal(resumed_losses, whole_losses[6:])
    np.testing.assert_array_equal(
        resumed["buffers"]["expert_bias"], whole["buffers"]["expert_bias"]
    )
