"""`titan-jax parity`: the table, the JSON, the exit codes."""

import json

import pytest

from titan_jax.cli import main
from titan_jax.models.qwen3 import Qwen3Args
from titan_jax.parity import torchtitan_ref

KEYS = (
    "logits_max_abs_diff",
    "kl_max",
    "greedy_match",
    "loss_abs_diff",
    "grads_max_rel_diff",
    "trajectory_max_rel_diff",
)
# vocab 2048: the trajectory trains on the embedded corpus with the shipped tokenizer.
TINY = Qwen3Args(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    hidden_dim=128,
    vocab_size=2048,
    tie_embeddings=True,
)
SMALL_RUN = ["--seq-len", "64", "--training.local_batch_size", "2", "--training.seq_len", "32"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, save_hf_checkpoint):
    return str(save_hf_checkpoint(TINY, tmp_path_factory.mktemp("tiny")))


def test_parity_cli_prints_the_table_writes_json_and_passes(
    tiny_checkpoint, tmp_path, capsys, torchtitan_available
):
    out = tmp_path / "parity.json"
    code = main(
        [
            "parity",
            "--config",
            "configs/qwen3_debug.toml",
            "--hf-checkpoint",
            tiny_checkpoint,
            "--reference",
            "all",
            "--trajectory-steps",
            "3",
            *SMALL_RUN,
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "logits max |diff|" in printed.out and printed.out.rstrip().endswith("PASS")
    report = json.loads(out.read_text())
    assert all(report[k] is not None for k in KEYS)
    assert report["passed"] and report["greedy_match"] is True
    assert report["grads_max_rel_diff"] <= 1e-4 and report["kl_max"] <= 1e-9
    assert set(report["references"]) == {"hf", "torchtitan"}
    assert report["trajectory"]["steps"] == 3 and report["trajectory_max_rel_diff"] <= 1e-5
    assert report["prompt_len"] == 64 and report["model"]["vocab_size"] == 2048


def test_parity_cli_fails_over_a_bar_and_when_a_reference_is_missing(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(torchtitan_ref, "unavailable_reason", lambda: "not installed (test)")
    out = tmp_path / "parity.json"
    code = main(
        [
            "parity",
            "--config",
            "configs/qwen3_debug.toml",
            "--hf-checkpoint",
            tiny_checkpoint,
            "--bar",
            "kl_max=-1",
            *SMALL_RUN,
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in printed and "torchtitan: unavailable: not installed (test)" in printed
    report = json.loads(out.read_text())
    assert not report["passed"] and report["trajectory_max_rel_diff"] is None
    assert report["bars"]["kl_max"] == -1
    assert any(f.startswith("hf: kl_max=") for f in report["failures"])


def test_parity_cli_bad_arguments(capsys):
    assert main(["parity", "--config", "configs/qwen3_debug.toml", "--bar", "kl=1"]) == 2
    assert (
        "--bar 'kl=1': expected NAME=NUMBER with NAME one of logits_max_abs_diff"
        in capsys.readouterr().err
    )
    for value in ("nan", "inf", "-inf"):
        assert (
            main(["parity", "--config", "configs/qwen3_debug.toml", "--bar", f"kl_max={value}"])
            == 2
        )
        assert capsys.readouterr().err == (
            f"titan-jax: error: --bar 'kl_max={value}': {value} "
            "must be a finite number (the largest kl_max that "
            "passes)\n"
        )
    assert (
        main(["parity", "--config", "configs/qwen3_debug.toml", "--hf-checkpoint", "/nonexistent"])
        == 2
    )
    assert "HF model directory /nonexistent does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_parity_cli_debug_model_on_a_512_token_prompt(capsys, torchtitan_available):
    """The issue's "done when": the debug recipe's model, all references, default prompt."""
    code = main(["parity", "--config", "configs/qwen3_debug.toml", "--reference", "all"])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "prompt 512 random tokens + 32 greedy tokens" in printed.out
