"""Tests for titan_jax/train/eval.py: the eval step and validation during training."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY

from titan_jax.config import ConfigError, load_config
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.data.windows import IGNORE_INDEX
from titan_jax.train import loop
from titan_jax.train.eval import Validator
from titan_jax.train.loss import token_cross_entropy_sum
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

VALIDATION = [
    "--validation.enable",
    "true",
    "--validation.seq_len",
    "16",
    "--validation.local_batch_size",
    "1",
    "--validation.steps",
    "2",
]


def make_config(folder, *overrides):
    return load_config(
        None,
        [
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "1",
            "--training.global_batch_size",
            "4",
            "--training.steps",
            "4",
            "--lr_scheduler.warmup_steps",
            "1",
            "--metrics.log_freq",
            "2",
            "--metrics.progress_bar",
            "false",
            *VALIDATION,
            *overrides,
        ],
    )


def reference_loss(trainer, params, batches):
    """Mean CE over all tokens of `batches`, from the model's logits on one device."""
    total = count = 0.0
    apply = jax.jit(trainer.plan.model.apply)  # one compile; eager dispatch costs more per batch
    for b in batches:
        logits = apply(params, jnp.asarray(b["inputs"]))
        total += float(
            token_cross_entropy_sum(
                logits.reshape(-1, logits.shape[-1]), jnp.asarray(b["labels"]).reshape(-1)
            )
        )
        count += b["labels"].size
    return total / count


@pytest.mark.parametrize(
    "mesh",
    [
        [],
        ["--job.cpu_devices", "4", "--parallelism.data_parallel_shard_degree", "4"],
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.fsdp_implementation",
            "shard_map",
        ],
    ],
)
def test_validation_loss_equals_the_model_on_any_mesh(tmp_path, mesh):
    config = make_config(tmp_path, *mesh, "--validation.local_batch_size", "2")
    devices = jax.devices()[:1] if not mesh else jax.devices()[:4]
    trainer = build_trainer(config, devices, model_args=TINY)
    validator = Validator(trainer, load_tokenizer(""))
    state = trainer.init_state()
    params = state["params"]
    result = validator.validate(state)
    one = build_trainer(make_config(tmp_path), jax.devices()[:1], model_args=TINY)
    host_params = jax.device_get(params)
    batches = list(validator.batches(2))
    assert result["val_batches"] == 2
    assert result["val_tokens"] == 2 * validator.global_batch_size * 16
    assert result["val_loss"] == pytest.approx(reference_loss(one, host_params, batches), rel=1e-6)
    assert result["val_perplexity"] == pytest.approx(math.exp(result["val_loss"]))
    assert result == validator.validate(state)  # the same batches every time


def test_too_small_validation_set_names_the_fields(tmp_path):
    config = make_config(
        tmp_path, "--validation.local_batch_size", "1000", "--validation.seq_len", "64"
    )
    trainer = build_trainer(config, jax.devices()[:1], model_args=TINY)
    with pytest.raises(ConfigError, match="validation.local_batch_size or validation.seq_len"):
        Validator(trainer, load_tokenizer(""))


def test_training_logs_validation(tmp_path, capsys):
    config = make_config(tmp_path, "--validation.freq", "3", "--metrics.enable_tensorboard", "true")
    loop.train(config, jax.devices()[:1], model_args=TINY)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Every validation.freq steps and the last, on its step's line (logged for it).
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 4]
    assert all(np.isclose(r["val_perplexity"], math.exp(r["val_loss"])) for r in rows[2:])
    # Steps 3 and 4 ran with a validation in their wall time: no step time, not a wrong one.
    assert rows[2]["step_time_s"] is None and rows[3]["step_time_s"] is None
    assert "validation at step 3: val_loss" in capsys.readouterr().out
    assert (tmp_path / "loss.png").stat().st_size > 1000
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert b"validation_metrics/loss" in events.read_bytes()


def test_bad_validation_source_names_the_field(tmp_path):
    config = make_config(
        tmp_path,
        "--validation.dataset",
        "jsonl",
        "--validation.dataset_path",
        str(tmp_path / "missing.jsonl"),
    )
    trainer = build_trainer(config, jax.devices()[:1], model_args=TINY)
    with pytest.raises(ConfigError, match=r"validation.dataset_path='.*missing.jsonl' does not"):
        Validator(trainer, load_tokenizer(""))


def test_validation_under_document_mask_equals_each_document_run_alone(tmp_path):
    """Validation reads what training reads: segment ids, per-document positions and the
    cross-document label ignored. The reference runs each document piece of each window alone."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(
        "".join(json.dumps({"text": f"doc {i} " + "word " * (i % 7)}) + "\n" for i in range(40))
    )  # 3-10 tokens: several per window
    config = make_config(
        tmp_path / "run",
        "--training.document_mask",
        "true",
        "--training.document_positions",
        "true",
        "--validation.dataset",
        "jsonl",
        "--validation.dataset_path",
        str(held_out),
    )
    trainer = build_trainer(config, jax.devices()[:1], model_args=TINY)
    validator = Validator(trainer, load_tokenizer(""))
    state = trainer.init_state()
    result = validator.validate(state)

    corpus = validator._windows.corpus
    tokens = corpus.read(0, corpus.num_tokens)
    ends = set(corpus.document_ends(0, corpus.num_tokens).tolist())
    pieces, labels = [], []  # each document's part of each window, and its labels
    for start in range(0, result["val_batches"] * validator.global_batch_size * 16, 16):
        cuts = [start] + [e for e in range(start + 1, start + 16) if e in ends] + [start + 16]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            pieces.append(tokens[a:b])
            label = tokens[a + 1 : b + 1].copy()
            if b in ends:  # this piece's last token is its document's EOS
                label[-1] = IGNORE_INDEX
            labels.append(label)
    width = max(map(len, pieces))  # padded at the end: causal, so padding reaches nothing
    alone = np.zeros((len(pieces), width), np.int32)
    alone_labels = np.full((len(pieces), width), IGNORE_INDEX, np.int32)
    for i, (piece, label) in enumerate(zip(pieces, labels, strict=True)):
        alone[i, : len(piece)], alone_labels[i, : len(piece)] = piece, label
    logits = jax.jit(trainer.plan.model.apply)(jax.device_get(state["params"]), jnp.asarray(alone))
    total = token_cross_entropy_sum(
        logits.reshape(-1, logits.shape[-1]), jnp.asarray(alone_labels).reshape(-1)
    )
    n_tokens = int((alone_labels != IGNORE_INDEX).sum())
    windows = result["val_batches"] * validator.global_batch_size
    assert len(pieces) > 2 * windows  # the windows hold document boundaries
    assert result["val_tokens"] == n_tokens < windows * 16
    assert result["val_loss"] == pytest.approx(float(total) / n_tokens, rel=1e-5)
