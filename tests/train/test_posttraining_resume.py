"""A LoRA SFT run of the shipped recipe (whole conversations packed into rows), killed with
SIGKILL mid-run and resumed: the resumed run's losses and its final params (base and adapters)
equal the uninterrupted run's bit for bit; the packer resumes where the killed run's last
checkpoint left it. (Full fine-tuning's kill -9 is test_resume.py's, on the same checkpoint
path.) The conversations are prepared into a store under the run folder on first use; a killed
run's successor reads that store, it does not prepare it again."""

import signal

import jax
import numpy as np
import pytest
from cli_args import QUIET_METRICS
from test_resume import ROOT, Run, env, finalized  # noqa: F401  (env: a fixture)

STEPS = 6
SFT = [
    "--config",
    str(ROOT / "configs" / "qwen3_debug_sft.toml"),
    "--training.steps",
    str(STEPS),
    "--training.seq_len",  # short rows, cheap steps; whole conversations (the recipe's
    "128",  # packing), those longer than a row cut to its length
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    *QUIET_METRICS,
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
    "--validation.enable",
    "false",
]
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "attention,mlp"]


def final_params(folder):
    """The params of the run's last checkpoint (adapters included), as numpy arrays."""
    import jax

    from titan_jax.models.qwen3 import QWEN3
    from titan_jax.train.model_io import load_orbax, run_lora

    step = folder / "checkpoint" / str(STEPS)
    return jax.device_get(load_orbax(step, QWEN3, lora=run_lora(step, QWEN3).lora)[1])


@pytest.mark.slow
def test_a_lora_sft_run_killed_mid_run_resumes_bitwise(env, tmp_path):  # noqa: F811
    extra = LORA
    whole = Run(env, tmp_path / "whole", *extra, args=SFT)
    whole.finish()
    expected = whole.losses()
    assert sorted(expected) == list(range(1, STEPS + 1))

    folder, ckpt = tmp_path / "killed", tmp_path / "killed" / "checkpoint"
    first = Run(env, folder, *extra, args=SFT)
    first.wait_for(
        lambda: ckpt.is_dir() and 2 in finalized(ckpt) and 3 in first.losses(),
        "checkpoint 2 and step 3",
    )
    first.signal(signal.SIGKILL)
    stores = sorted(p.name for p in (folder / "data").iterdir())

    second = Run(env, folder, *extra, args=SFT)
    out = second.finish()
    assert "resuming at step 3 from checkpoint" in out or "resuming at step 4" in out, out
    assert sorted(p.name for p in (folder / "data").iterdir()) == stores  # not prepared again
    losses = {**first.losses(), **second.losses()}
    assert losses == expected
    jax.tree.map(
        np.testing.assert_array_equal, final_params(folder), final_params(tmp_path / "whole")
    )
