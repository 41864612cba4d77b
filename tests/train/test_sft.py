"""Supervised fine-tuning through the CLI: the shipped SFT recipe, whole conversations a row,
lowers the held-out loss on the assistant's tokens; a tokenizer without a chat template is one
line whose hint works."""

import json
import shutil

import jax
import pytest
from cli_args import QUIET_METRICS

from titan_jax.cli import main

RECIPE = "configs/qwen3_debug_sft.toml"
QUIET = [
    *QUIET_METRICS,
    "--checkpoint.enable",
    "false",
]


@pytest.fixture
def one_device(monkeypatch):
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])


@pytest.mark.slow
def test_the_sft_recipe_lowers_the_held_out_loss_on_the_assistants_tokens(
    tmp_path, capsys, one_device
):
    code = main(
        [
            "train",
            "--config",
            RECIPE,
            *QUIET,
            "--training.steps",
            "4",
            "--training.local_batch_size",
            "1",
            "--lr_scheduler.warmup_steps",
            "2",
            "--validation.freq",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    # Whole conversations a row, said once with the padding share and the cut ones.
    assert out.out.count("70 conversations packed whole into 37 rows of 1024 tokens") == 1
    assert "2 longer than training.seq_len=1024 keep their first 1024 tokens" in out.out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    held_out = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(held_out) == 2 and held_out[-1] < held_out[0] < 7.7, held_out
    # The store the recipe prepared holds its conversations' loss mask.
    (manifest,) = tmp_path.glob("data/jsonl-train-*/manifest.json")
    assert json.loads(manifest.read_text())["loss_mask"] is True


def test_a_tokenizer_without_a_chat_template_is_one_line_and_its_hint_works(
    tmp_path, capsys, one_device
):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy("titan_jax/data/assets/tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    argv = [
        "train",
        "--config",
        RECIPE,
        *QUIET,
        "--training.steps",
        "1",
        "--validation.enable",
        "false",
        "--training.seq_len",
        "32",
        "--model.tokenizer_path",
        str(folder),
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no chat_template" in err[0], err
    assert "--training.chat_template FILE" in err[0]
    assert not (tmp_path / "run").exists()
    # Following the hint: a template file.
    template = tmp_path / "chat.jinja"
    shutil.copy("titan_jax/data/assets/chat_template.jinja", template)
    assert main([*argv, "--training.chat_template", str(template)]) == 0


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": "Hi"}], "chat.jsonl:2: messages has no assistant message"),
        (
            [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hey"}],
            "chat.jsonl:2: messages[1] has role 'bot'; valid roles: system, user, assistant, tool",
        ),
    ],
    ids=["no-assistant-turn", "unknown-role"],
)
def test_a_bad_conversation_is_one_line_at_train_and_nothing_is_written(
    tmp_path, capsys, one_device, messages, message
):
    """train prepares its store under the run folder on first use: a bad record found there
    leaves no run folder behind."""
    good = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (good, messages)))
    argv = ["train", "--config", RECIPE, *QUIET, "--training.steps", "1"]
    argv += ["--validation.enable", "false", "--training.dataset_path", str(data)]
    assert main([*argv, "--job.dump_folder", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titan-jax: error: ") and message in err[0], err
    assert not (tmp_path / "run").exists()
