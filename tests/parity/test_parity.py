"""titan-jax against HF transformers and TorchTitan on tiny fp32 models: DESIGN.md section 4's
bars on >= 512-token prompts, a 20-step training trajectory, and a bug that must be caught."""

import dataclasses
import json

import numpy as np
import pytest

from titan_jax.config import load_config
from titan_jax.models.qwen3 import QWEN3, Qwen3Args, build_model_def
from titan_jax.models.qwen3.args import YarnScaling
from titan_jax.models.qwen3.hf import load_hf_params
from titan_jax.parity import BARS, metrics
from titan_jax.parity.ours import train_trajectory
from titan_jax.parity.run import ParityReport, ReferenceResult, Trajectory, run_parity

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

# Between them: tied and untied, GQA ratios 2/4/1, head_dim != dim/heads (twice), 2-4 layers,
# a non-default rope_theta and norm eps.
SHAPES = {
    "tied-gqa2-hd32": Qwen3Args(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=128,
        vocab_size=256,
        tie_embeddings=True,
    ),
    "untied-gqa4-3layers": Qwen3Args(
        dim=64,
        n_layers=3,
        n_heads=8,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=96,
        vocab_size=320,
        tie_embeddings=False,
    ),
    "untied-mha-4layers-hd16": Qwen3Args(
        dim=48,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        head_dim=16,
        hidden_dim=80,
        vocab_size=256,
        tie_embeddings=False,
        rope_theta=1e4,
        norm_eps=1e-5,
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_hf_and_torchtitan(name, tmp_path, save_hf_checkpoint, torchtitan_available):
    args = SHAPES[name]
    report = run_parity(args, save_hf_checkpoint(args, tmp_path), prompt_len=512)
    assert report.failures() == []
    for ref in report.references.values():
        assert ref.unavailable is None
        assert ref.logits_max_abs_diff <= 1e-4 and ref.kl_max <= 1e-9, ref
        assert ref.greedy_match and ref.loss_rel_diff <= 1e-5, ref
        assert len(ref.kl_per_token) == 512 + 32 - 1
    assert report.references["hf"].grads_max_rel_diff <= 1e-4
    assert report.references["torchtitan"].grads_max_rel_diff is None  # forward-only on CPU


def test_yarn_matches_hf(tmp_path, save_hf_checkpoint):
    """YaRN (factor 8 over an original window of 128 positions) on 512 + 32 tokens: positions
    far past the original window, where every interpolated, ramped and kept dim shows."""
    args = dataclasses.replace(
        SHAPES["tied-gqa2-hd32"],
        max_seq_len=1024,
        yarn=YarnScaling(factor=8.0, original_max_position_embeddings=128),
    )
    report = run_parity(
        args, save_hf_checkpoint(args, tmp_path), references=("hf",), prompt_len=512
    )
    hf = report.references["hf"]
    assert report.failures() == [], report.failures()
    assert hf.logits_max_abs_diff <= 1e-4 and hf.kl_max <= 1e-9, hf
    assert hf.greedy_match and hf.grads_max_rel_diff <= 1e-4, hf


def learnable_batches(vocab: int, steps: int, rows: int = 2, seq_len: int = 64, seed: int = 0):
    """Runs of consecutive token ids (mod vocab) from random starts: a bigram pattern the model
    picks up within a few steps, so the trajectory compares real optimizer progress rather than
    noise around log(vocab)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        w = (rng.integers(0, vocab, (rows, 1)) + np.arange(seq_len + 1)) % vocab
        out.append({"inputs": w[:, :-1].astype(np.int32), "labels": w[:, 1:].astype(np.int32)})
    return out


def test_20_step_trajectory_matches_the_pytorch_loop(
    tmp_path, save_hf_checkpoint, torchtitan_available
):
    from titan_jax.parity import hf_ref, torchtitan_ref

    args = SHAPES["untied-gqa4-3layers"]
    path = save_hf_checkpoint(args, tmp_path)
    # Warmup, stable, cosine decay to a floor, clipping and weight decay all take part. The LR
    # stays where training is not chaotic: at 5e-3 this tiny model amplifies fp32 rounding so
    # much that PyTorch against itself, with 1e-7 relative noise on the weights, drifts 1e-5
    # apart within 5 steps; titan-jax vs PyTorch drifts exactly as much, no more.
    recipe = load_config(
        None,
        [
            "--optimizer.lr",
            "3e-3",
            "--lr_scheduler.warmup_steps",
            "4",
            "--lr_scheduler.decay_ratio",
            "0.5",
            "--lr_scheduler.decay_type",
            "cosine",
            "--lr_scheduler.min_lr_factor",
            "0.1",
            "--training.max_norm",
            "0.5",
        ],
    )
    batches = learnable_batches(args.vocab_size, 20)
    ours, our_lrs = train_trajectory(
        build_model_def(args), load_hf_params(path, args), recipe, batches
    )
    ref, ref_lrs = hf_ref.train_trajectory(
        path, recipe, batches, torchtitan_ref.lr_scheduler(recipe.lr_scheduler)
    )
    trajectory = Trajectory(ours, ref, our_lrs, ref_lrs)
    assert trajectory.max_rel_diff <= 1e-5, trajectory.rel_diffs
    np.testing.assert_allclose(our_lrs, ref_lrs, rtol=1e-6)
    assert ref_lrs[3] == pytest.approx(3e-3) and ref_lrs[-1] < 1e-3
    assert ours[-1] < ours[0] - 0.5  # it learned: the curves compare real updates


def test_a_perturbed_weight_is_caught(tmp_path, save_hf_checkpoint, monkeypatch):
    args = SHAPES["tied-gqa2-hd32"]
    path = save_hf_checkpoint(args, tmp_path)

    def perturbed(*a, **k):  # titan-jax reads one k_norm weight 0.5% off
        params = load_hf_params(*a, **k)
        w = params["layers"]["attention"]["k_norm"]["weight"]
        params["layers"]["attention"]["k_norm"]["weight"] = w.at[1, 3].multiply(1.005)
        return params

    monkeypatch.setattr(QWEN3.hf, "load_params", perturbed)  # what run_parity reads through
    report = run_parity(args, path, references=("hf",), prompt_len=64, decode_tokens=4)
    hf = report.references["hf"]
    assert hf.grads_max_rel_diff > BARS["grads_max_rel_diff"]
    assert any(f.startswith("hf: grads_max_rel_diff=") for f in report.failures())
    assert hf.logits_max_abs_diff > 1e-6  # visible in the forward too


def _report(**hf_fields) -> ParityReport:
    hf = ReferenceResult(
        "hf",
        logits_max_abs_diff=1e-6,
        kl_max=1e-14,
        greedy_match=True,
        loss_rel_diff=0.0,
        grads_max_rel_diff=1e-6,
    )
    for key, value in hf_fields.items():
        setattr(hf, key, value)
    tt = ReferenceResult("torchtitan", unavailable="not installed")
    return ParityReport(
        SHAPES["tied-gqa2-hd32"], "test", 8, 4, 1.0, {"hf": hf, "torchtitan": tt}, dict(BARS)
    )


def test_failures_name_every_figure_over_its_bar():
    report = _report(kl_max=float("nan"), greedy_match=False, greedy_first_mismatch=3)
    report.trajectory = Trajectory([1.0, 2.0], [1.0, 2.1], [0.1, 0.1], [0.1, 0.1])
    failures = report.failures()
    assert "torchtitan: unavailable: not installed" in failures
    assert "hf: kl_max=nan is over the bar 1e-09" in failures  # NaN fails, never passes
    assert "hf: greedy decode differs from titan-jax's at token 3" in failures
    assert any(f.startswith("trajectory: max per-step loss rel diff 0.0476") for f in failures)
    summary = report.to_json()
    assert summary["passed"] is False and summary["greedy_match"] is False
    assert summary["references"]["torchtitan"]["unavailable"] == "not installed"
    assert "FAIL" in report.table() and "unavailable" in report.table()


def test_metrics():
    ref = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    assert metrics.kl_per_token(ref, ref).max() == 0.0
    ours = np.log(np.array([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8]]))
    kl = metrics.kl_per_token(ref, ours)
    assert kl[0] == pytest.approx(0.7 * np.log(7 / 6) + 0.2 * np.log(2 / 3)) and kl[1] == 0
    logits = np.eye(4)[[1, 2, 3, 0]]  # position t predicts token (t + 1) % 4
    assert metrics.first_greedy_mismatch(logits, np.array([0, 1, 2, 3]), 2) is None
    assert metrics.first_greedy_mismatch(logits, np.array([0, 1, 2, 0]), 2) == 1
    assert metrics.rel_diff(np.array([3.0, 4.0]), np.array([3.0, 4.5])) == pytest.approx(
        0.5 / np.hypot(3, 4.5)
    )


def test_trajectory_batches_refuse_a_document_mask_and_write_no_store_in_the_run_folder(tmp_path):
    """The references attend across documents: a masked recipe is refused, not silently
    unmasked. A file source's store goes to the caller's folder, not the recipe's run folder
    (which a training run may hold)."""
    from titan_jax.config import ConfigError, load_config
    from titan_jax.parity.run import corpus_batches

    (tmp_path / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i} " + "words " * 40}) + "\n" for i in range(40))
    )
    run = tmp_path / "run"
    argv = [
        "--training.dataset",
        "jsonl",
        "--training.dataset_path",
        str(tmp_path / "corpus.jsonl"),
        "--training.seq_len",
        "16",
        "--training.local_batch_size",
        "2",
        "--job.dump_folder",
        str(run),
    ]
    with pytest.raises(ConfigError, match="^training.document_mask=true: the PyTorch"):
        corpus_batches(load_config(None, [*argv, "--training.document_mask", "true"]), 2048, 2)
    batches = corpus_batches(
        load_config(None, argv), 2048, 2, store_folder=str(tmp_path / "scratch")
    )
    assert len(batches) == 2 and batches[0]["inputs"].shape == (2, 16)
    assert not run.exists() and any((tmp_path / "scratch").iterdir())
