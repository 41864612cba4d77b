"""`titan-jax prepare-data`, then `train` from a mixture of token stores with document masking
and validation from a held-out store: the whole data path through the CLI."""

import json
from types import SimpleNamespace

import jax
import pytest

from titan_jax.cli import main


def test_prepare_then_train_on_a_masked_mixture_with_a_held_out_store(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])
    for name, n in (("web", 60), ("code", 30), ("held_out", 20)):
        src = tmp_path / f"{name}.jsonl"
        src.write_text(
            "".join(
                json.dumps({"text": f"{name} {i} " + "word " * (i % 9 + 3)}) + "\n"
                for i in range(n)
            )
        )
        assert (
            main(
                [
                    "prepare-data",
                    "--training.dataset",
                    "jsonl",
                    "--training.dataset_path",
                    str(src),
                    "--output",
                    str(tmp_path / name),
                ]
            )
            == 0
        )
    recipe = tmp_path / "mix.toml"
    recipe.write_text(f"""
[training]
seq_len = 16
local_batch_size = 4
steps = 3
document_mask = true
document_positions = true
[[training.mixture]]
path = "{tmp_path / "web"}"
weight = 3
[[training.mixture]]
path = "{tmp_path / "code"}"
weight = 1
[validation]
enable = true
dataset = "tokens"
dataset_path = "{tmp_path / "held_out"}"
seq_len = 16
local_batch_size = 2
freq = 3
steps = 2
[metrics]
log_freq = 1
progress_bar = false
""")
    code = main(
        [
            "train",
            "--config",
            str(recipe),
            "--lr_scheduler.warmup_steps",
            "1",
            "--job.dump_folder",
            str(tmp_path / "run"),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    web, held = str(tmp_path / "web"), rows[-1]
    # 4 rows x 16 tokens a step, 3 of every 4 samples from web (an even interleave).
    assert [r[f"tokens_seen/{web}"] + r[f"tokens_seen/{tmp_path / 'code'}"] for r in rows] == [
        64,
        128,
        192,
    ]
    assert 0.6 < held[f"tokens_seen/{web}"] / 192 < 0.9
    assert held["val_loss"] > 0
    # Documents of 5-15 tokens: several boundaries per 16-token window, their labels ignored.
    assert all(32 < r["n_tokens"] < 64 for r in rows)
    assert not (tmp_path / "run" / "data").exists()  # stores given: nothing prepared


def test_document_masking_with_cudnn_attention_is_refused_in_one_line():
    from titan_jax.config import ConfigError, load_config
    from titan_jax.data.tokenizer import load_tokenizer
    from titan_jax.train.run_checks import check_data

    config = load_config(None, ["--training.document_mask", "true"])
    with pytest.raises(
        ConfigError,
        match="document_mask=true needs model.attention=xla or "
        "splash: the cudnn attention here takes no segment ids",
    ):
        check_data(config, SimpleNamespace(vocab_size=2048), "cudnn", load_tokenizer())
