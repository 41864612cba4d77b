"""A LoRA run's checkpoint exported: `convert --to peft` gives PEFT's adapter directory, which
PEFT 0.21.2 loads onto the HF base to the adapted model's logits; `convert --to hf` and
`checkpoint.last_save_in_hf` give the adapters merged into one plain HF model, which
transformers loads to the same logits; `generate` decodes the merged model. Bad input is
refused in one line."""

import json
import os

import jax
import numpy as np
import pytest
from cli_args import QUIET_METRICS
from hf_fixtures import random_hf_model
from safetensors import safe_open
from tiny_model import TINY

from titan_jax.cli import main
from titan_jax.config import load_config
from titan_jax.models.frozen_base import FrozenBase
from titan_jax.models.lora import Lora
from titan_jax.models.qwen3 import build_model_def
from titan_jax.models.spec import BuildOptions
from titan_jax.train import loop

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

try:  # the `parity` extra; CI installs it, so there a missing one is a failure, not a skip
    import peft
    import torch
    import transformers
except ImportError as e:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"needs the parity extra: {e}", allow_module_level=True)

RANK, ALPHA = 4, 8.0
# Not PEFT's file order: the adapter file and config must not depend on it.
TARGETS = ("v_proj", "q_proj", "o_proj", "down_proj", "gate_proj")
STEPS = 2


def train(folder, hf_base, *overrides):
    """A 2-step run from the HF base `hf_base` (final checkpoint saved, model only): its
    params, and its last step folder. The large lr moves the adapters far enough in 2 steps
    to change the model's greedy continuation."""
    config = load_config(
        None,
        [
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            str(STEPS),
            "--training.mixed_precision_param",
            "float32",
            "--optimizer.lr",
            "1e-1",
            "--lr_scheduler.warmup_steps",
            "1",
            *QUIET_METRICS,
            "--checkpoint.enable",
            "true",
            "--checkpoint.initial_load_path",
            str(hf_base),
            "--checkpoint.initial_load_in_hf",
            "true",
            *overrides,
        ],
    )
    result = loop.train(config, jax.devices()[:1], model_args=TINY)
    return jax.device_get(result.state["params"]), folder / "checkpoint" / str(STEPS)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A LoRA run (its adapters trained away from zero, `last_save_in_hf` on) and the HF base
    it started from."""
    root = tmp_path_factory.mktemp("lora_export")
    random_hf_model(TINY).save_pretrained(root / "base")
    params, step = train(
        root / "run",
        root / "base",
        "--lora.rank",
        str(RANK),
        "--lora.alpha",
        str(ALPHA),
        "--lora.target_modules",
        ",".join(TARGETS),
        "--checkpoint.last_save_in_hf",
        "true",
    )
    return root, params, step


TOKENS = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 16))


def adapted_logits(params):
    model = build_model_def(TINY, BuildOptions(lora=Lora(RANK, ALPHA, TARGETS)))
    return np.asarray(model.apply(params, TOKENS))


def hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def base_model(root):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(root / "base"), dtype=torch.float32
    ).eval()


def convert(*argv):
    return main(["convert", *map(str, argv)])


def test_to_peft_loads_in_peft_as_the_adapted_model(run, tmp_path):
    root, params, step = run
    assert convert("--from", "orbax", "--to", "peft", step, tmp_path / "peft") == 0
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    ours = adapted_logits(params)
    peft_model = peft.PeftModel.from_pretrained(base_model(root), str(tmp_path / "peft")).eval()
    np.testing.assert_allclose(hf_logits(peft_model), ours, rtol=0, atol=1e-5)
    # The adapters matter: the base alone is far from these logits.
    assert np.abs(hf_logits(base_model(root)) - ours).max() > 1e-2

    # What PEFT itself saves for these settings: the same tensor names and shapes, and the
    # same value for every config field we write (the base's path included).
    theirs = peft.get_peft_model(
        base_model(root),
        peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), task_type="CAUSAL_LM"
        ),
    )
    theirs.save_pretrained(str(tmp_path / "theirs"))

    def shapes(folder):
        with safe_open(str(folder / "adapter_model.safetensors"), "np") as f:
            return {k: f.get_slice(k).get_shape() for k in f.keys()}

    assert shapes(tmp_path / "peft") == shapes(tmp_path / "theirs")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    their_config = json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(root / "base")
    # PEFT holds target_modules as a set: its file's order is the set's.
    their_config["target_modules"] = sorted(their_config["target_modules"])
    assert {k: their_config[k] for k in config} == config


def test_to_hf_and_last_save_in_hf_write_the_merged_model(run, tmp_path):
    root, params, step = run
    # The run's checkpoint folder: its newest step (beside it, hf-2/ is no step).
    assert convert("--from", "orbax", "--to", "hf", step.parent, tmp_path / "merged") == 0
    ours = adapted_logits(params)
    for folder in (tmp_path / "merged", step.parent / f"hf-{STEPS}"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32
        ).eval()
        assert not any("lora" in name for name, _ in model.named_parameters())
        np.testing.assert_allclose(hf_logits(model), ours, rtol=0, atol=1e-5, err_msg=folder)


@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_a_qlora_run_exports_its_quantized_base_merged(run, tmp_path, base_dtype):
    """The merged model of a run whose frozen base is quantized holds the base as the run used
    it (dequantized) plus the adapters: transformers gives the adapted model's logits."""
    root, _, _ = run
    params, step = train(
        tmp_path / "run",
        root / "base",
        "--lora.rank",
        str(RANK),
        "--lora.alpha",
        str(ALPHA),
        "--lora.target_modules",
        ",".join(TARGETS),
        "--lora.base_dtype",
        base_dtype,
        *(["--lora.base_block_size", "8"] if base_dtype == "nf4" else []),  # TINY's inputs: 32
    )
    assert convert("--from", "orbax", "--to", "hf", step, tmp_path / "merged") == 0
    base = FrozenBase(base_dtype, block_size=8 if base_dtype == "nf4" else 64)
    model = build_model_def(TINY, BuildOptions(lora=Lora(RANK, ALPHA, TARGETS, base=base)))
    ours = np.asarray(model.apply(params, TOKENS))
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(hf_logits(merged), ours, rtol=0, atol=1e-5)
    # A projection without adapters is the base as the run held it (dequantized, as PEFT's
    # merge of a 4-bit base gives it), not the HF base's float weight.
    name = "model.layers.0.self_attn.k_proj.weight"
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "np") as f:
        exported = f.get_tensor(name)
    with safe_open(str(root / "base" / "model.safetensors"), "np") as f:
        original = f.get_tensor(name)
    error = np.abs(exported - original).max()
    assert 0 < error < 0.2 * np.abs(original).max(), error


def test_generate_decodes_the_adapted_model(run, tmp_path, capsys, monkeypatch):
    root, params, step = run
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])  # as training's
    assert convert("--from", "orbax", "--to", "hf", step, tmp_path / "merged") == 0

    def generate(*source):
        assert (
            main(
                [
                    "generate",
                    "--config",
                    "configs/qwen3_debug.toml",
                    "--prompt",
                    "The for",
                    "--max-new-tokens",
                    "8",
                    *map(str, source),
                ]
            )
            == 0
        )
        return capsys.readouterr().out

    capsys.readouterr()
    adapted = generate("--checkpoint", step)
    assert adapted == generate("--hf-checkpoint", tmp_path / "merged")
    # The adapters change the greedy continuation: the base model's differs.
    assert adapted != generate("--hf-checkpoint", root / "base")


def test_to_peft_from_a_run_without_adapters_is_refused(run, tmp_path, capsys):
    root, _, _ = run
    _, step = train(tmp_path / "full", root / "base")
    assert convert("--from", "orbax", "--to", "peft", step, tmp_path / "peft") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no LoRA adapters" in err, err
    assert not (tmp_path / "peft").exists()


def test_to_peft_from_hf_is_refused(run, tmp_path, capsys):
    root, _, _ = run
    assert convert("--from", "hf", "--to", "peft", root / "base", tmp_path / "peft") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--to peft writes a LoRA run's adapters" in err, err


def test_to_peft_into_a_non_empty_destination_is_refused(run, tmp_path, capsys):
    _, _, step = run
    dst = tmp_path / "peft"
    dst.mkdir()
    (dst / "mine.txt").write_text("keep me")
    assert convert("--from", "orbax", "--to", "peft", step, dst) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"destination {dst} exists and is not empty" in err, err
    assert [p.name for p in dst.iterdir()] == ["mine.txt"]
    assert (dst / "mine.txt").read_text() == "keep me"
