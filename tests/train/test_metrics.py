"""Tests for titan_jax/train/metrics.py: counts, FLOPs, peak FLOP/s, memory and the log sinks."""

import json
import math
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from titan_jax.config_schema import LORA_GROUPS
from titan_jax.models.lora import Lora
from titan_jax.models.qwen3 import build_model_def
from titan_jax.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from titan_jax.models.qwen3.flops import adapter_params, count_params, flops_per_token
from titan_jax.models.spec import BuildOptions
from titan_jax.train import metrics, peak_flops
from titan_jax.train.metrics import MetricsFileError, MetricsLogger, memory_stats
from titan_jax.train.peak_flops import peak_flops_per_device
from titan_jax.trees import split_by_name

# Published totals with a tied embedding counted once (model cards: 0.6B / 1.7B / 4B total with
# 0.44B / 1.4B / 3.6B non-embedding). The hub's safetensors counts for 0.6B and 1.7B (0.75B,
# 2.03B) are larger because those checkpoints also store the tied lm_head: 1.72e9 + 0.31e9.
PUBLISHED_TOTAL = {
    "0.6B": 0.596e9,
    "1.7B": 1.72e9,
    "4B": 4.02e9,
    "8B": 8.19e9,
    "14B": 14.77e9,
    "32B": 32.76e9,
    "30B-A3B": 30.53e9,
    "235B-A22B": 235.09e9,
}
QWEN3_30B_A3B = Qwen3Args(
    dim=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    vocab_size=151936,
    tie_embeddings=False,
    num_experts=128,
    top_k=8,
    moe_inter_dim=768,
)
QWEN3_235B_A22B = Qwen3Args(
    dim=4096,
    n_layers=94,
    n_heads=64,
    n_kv_heads=4,
    vocab_size=151936,
    tie_embeddings=False,
    num_experts=128,
    top_k=8,
    moe_inter_dim=1536,
)
DEBUG_MOE = Qwen3Args(num_experts=64, top_k=8, moe_inter_dim=768)  # debugmodel_moe's shape


@pytest.mark.parametrize("name", [n for n in QWEN3_FLAVORS if not n.startswith("debugmodel")])
def test_count_params_matches_published_size(name):
    assert name in PUBLISHED_TOTAL, f"flavour {name!r}: add its published size to this test"
    counts = count_params(QWEN3_FLAVORS[name])
    assert counts["total"] == pytest.approx(PUBLISHED_TOTAL[name], rel=0.01)


def test_count_params_moe_published_total_and_active():
    big = count_params(QWEN3_30B_A3B)
    assert big["total"] == pytest.approx(PUBLISHED_TOTAL["30B-A3B"], rel=0.01)
    assert big["active"] == pytest.approx(3.3e9, abs=0.06e9)  # "3.3B activated"
    huge = count_params(QWEN3_235B_A22B)
    assert huge["total"] == pytest.approx(PUBLISHED_TOTAL["235B-A22B"], rel=0.01)
    assert huge["active"] == pytest.approx(22e9, abs=0.5e9)  # "22B activated"


def test_count_params_debugmodel_by_hand():
    d, hd, hidden, vocab, layers = 256, 128, 3072, 2048, 8
    per_layer = (
        d * 16 * hd  # wq
        + 2 * d * 8 * hd  # wk, wv
        + 16 * hd * d  # wo
        + 2 * hd  # q_norm, k_norm
        + 2 * d  # attention_norm, ffn_norm
        + 3 * d * hidden  # w1, w3, w2
    )
    total = vocab * d + layers * per_layer + d  # tied: no separate lm_head
    assert total == 31_987_968
    assert count_params(QWEN3_FLAVORS["debugmodel"]) == {
        "total": total,
        "embedding": vocab * d,
        "active": total,
    }


def test_flops_per_token_debugmodel_by_hand():
    seq_len = 512
    n = 31_987_968  # every parameter (test above); tied, so the embedding counts as the lm_head
    attention = 6 * 8 * 16 * (2 * 128) * seq_len  # layers * heads * (q.k + attn.v dims) * T
    assert flops_per_token(QWEN3_FLAVORS["debugmodel"], seq_len) == 6 * n + attention
    assert 6 * n + attention == 292_591_104


def test_flops_per_token_moe_counts_top_k_experts_and_full_router():
    d, layers = 256, 8
    experts_all = 3 * 64 * d * 768
    attention_and_norms = 2 * d * 2048 + 2 * d * 1024 + 2 * 128 + 2 * d
    router = d * 64  # counted in full
    per_layer_active = attention_and_norms + router + experts_all * 8 // 64  # 8 of 64 experts
    n = 2048 * d + layers * per_layer_active + d
    assert count_params(DEBUG_MOE)["active"] == n
    assert count_params(DEBUG_MOE)["total"] == n + layers * experts_all * 56 // 64
    assert flops_per_token(DEBUG_MOE, 128) == 6 * n + 6 * layers * 16 * 256 * 128


def test_flops_per_token_untied_excludes_only_the_lookup():
    counts = count_params(QWEN3_30B_A3B)
    n = counts["active"] - counts["embedding"]  # lm_head stays in
    assert flops_per_token(QWEN3_30B_A3B, 4096) == 6 * n + 6 * 48 * 32 * 256 * 4096


def test_tied_and_untied_differ_in_params_not_flops():
    tied = QWEN3_FLAVORS["debugmodel"]
    untied = Qwen3Args(tie_embeddings=False)
    embedding = tied.vocab_size * tied.dim
    assert count_params(untied)["total"] - count_params(tied)["total"] == embedding
    # Both run the lm_head matmul; the lookup costs no FLOPs. A tied count that dropped the
    # shared matrix would be 6 * embedding lower.
    assert flops_per_token(untied, 256) == flops_per_token(tied, 256)


@pytest.mark.parametrize(
    ("args", "projections"),
    [
        (QWEN3_FLAVORS["debugmodel"], LORA_GROUPS["attention"] + LORA_GROUPS["mlp"]),
        (DEBUG_MOE, ("q_proj", "v_proj", *LORA_GROUPS["experts"])),
    ],
    ids=["dense", "moe"],
)
def test_lora_flops_price_the_frozen_base_without_its_weight_gradients(args, projections):
    """4 FLOPs a base parameter (no weight gradient), 6 an adapter parameter; the adapter
    counts are the built model's (its trainable params), experts' scaled by top_k."""
    lora = Lora(rank=8, alpha=16.0, projections=projections)
    model = build_model_def(args, BuildOptions(lora=lora))
    adapters = split_by_name(model.abstract_params, model.trainable)[0]
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))
    counted = adapter_params(args, lora)
    assert counted["total"] == total
    if args.is_moe:
        experts = sum(math.prod(x.shape) for x in jax.tree.leaves(adapters["layers"]["moe"]))
        assert counted["active"] == total - experts + experts * args.top_k // args.num_experts
    n = count_params(args)["active"] - (
        0 if args.tie_embeddings else count_params(args)["embedding"]
    )
    attention = flops_per_token(args, 256) - 6 * n
    assert flops_per_token(args, 256, lora) == 4 * n + 6 * counted["active"] + attention


def fake_device(kind: str, platform: str = "gpu") -> SimpleNamespace:
    return SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("TPU v5p", 459e12),
        ("TPU v5", 459e12),
        ("TPU v5 lite", 197e12),
        ("TPU v6 lite", 918e12),
        ("TPU v4", 275e12),
        ("TPU7x", 2307e12 / 2),  # JAX shows an Ironwood chip as two devices
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ],
)
def test_peak_table_lookup(kind, peak, monkeypatch):
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", pytest.fail)  # must not measure
    result = peak_flops_per_device(fake_device(kind, "tpu" if "TPU" in kind else "gpu"), "float32")
    assert (result.flops_per_device, result.method) == (peak, "published")
    assert "dense bf16 peak" in result.source


def test_cpu_peak_is_measured_at_every_start(monkeypatch):
    calls = []

    def fake_measure(device, dtype):
        calls.append(dtype)
        return 1.5e11 + len(calls)

    monkeypatch.setattr(peak_flops, "measure_matmul_flops", fake_measure)
    cpu = jax.devices("cpu")[0]
    first = peak_flops_per_device(cpu, "float32")
    assert (first.flops_per_device, first.method) == (1.5e11 + 1, "measured")
    assert "median of 7 timed 1024^3 float32 matmuls" in first.source
    # Never a number remembered from an earlier run: each run measures its own machine's state.
    assert peak_flops_per_device(cpu, "float32").flops_per_device == 1.5e11 + 2
    assert calls == ["float32", "float32"]


def test_override_wins_without_measuring(monkeypatch):
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", pytest.fail)
    result = peak_flops_per_device(fake_device("NVIDIA H100 80GB HBM3"), "bfloat16", 1e12)
    assert result.to_json() == {
        "peak_flops_per_device": 1e12,
        "peak_flops_method": "override",
        "peak_flops_source": "metrics.peak_flops=1e+12",
    }


def test_unknown_accelerator_falls_back_to_measuring(monkeypatch):
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: 7e13)
    result = peak_flops_per_device(fake_device("NVIDIA GeForce RTX 4090"), "bfloat16")
    assert (result.flops_per_device, result.method) == (7e13, "measured")
    assert result.source.startswith("unknown device kind 'NVIDIA GeForce RTX 4090': matmul peak")


def test_measure_matmul_flops_is_plausible():
    flops = peak_flops.measure_matmul_flops(jax.devices("cpu")[0], "float32", n=256, runs=3)
    assert 1e8 < flops < 1e13  # this CPU does ~2e11 at 1024^3; 256^3 is slower but not 1000x


def test_memory_stats_falls_back_to_process_rss():
    stats = memory_stats()
    assert stats["source"] == "process_rss"  # the CPU backend reports no device stats
    assert stats["peak_bytes"] >= stats["bytes_in_use"] > 50 * 2**20  # jax alone is > 50 MiB


def test_memory_stats_prefers_device(monkeypatch):
    device = SimpleNamespace(memory_stats=lambda: {"bytes_in_use": 10, "peak_bytes_in_use": 30})
    monkeypatch.setattr(metrics.jax, "local_devices", lambda: [device])
    assert memory_stats() == {"source": "device", "peak_bytes": 30, "bytes_in_use": 10}


def step_metrics(step: int, **overrides: float) -> dict[str, float]:
    values = dict(
        loss=10.0 / step,
        grad_norm=1.0,
        lr=3e-4,
        tokens_per_sec=250.0,
        mfu_pct=12.5,
        step_time_s=8.0,
        memory_peak_gib=1.25,
    )
    return values | overrides


def read_jsonl(path: Path) -> list[dict]:
    def reject(token):
        raise ValueError(f"invalid JSON constant {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_log_writes_jsonl_lines(tmp_path):
    with MetricsLogger(str(tmp_path), log_freq=1, total_steps=3, progress_bar=False) as logger:
        logger.log(1, step_metrics(1, grad_norm=np.float32(2.5)))
        logger.log(2, step_metrics(2, grad_norm=float("nan"), loss=float("inf")))
        logger.log(3, step_metrics(3, tokens_per_sec=jax.numpy.float32(300.0)))
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[0] == {"step": 1} | step_metrics(1, grad_norm=2.5)
    assert lines[1]["grad_norm"] is None and lines[1]["loss"] is None  # valid JSON, not NaN
    assert lines[2]["tokens_per_sec"] == 300.0
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_resumed_run_appends_and_plots_whole_curve(tmp_path):
    with MetricsLogger(str(tmp_path), log_freq=1, total_steps=4, progress_bar=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, step_metrics(step))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # killed mid-write
    # Resumed without keep_through (a caller that does not know the step): appended.
    with MetricsLogger(str(tmp_path), log_freq=1, total_steps=4, progress_bar=False) as logger:
        for step in (2, 3, 4):
            logger.log(step, step_metrics(step, loss=float(step)))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 7 and lines[3] == '{"step": 4, "lo'
    assert [json.loads(line)["step"] for line in lines[4:]] == [2, 3, 4]
    curve = metrics._curve(tmp_path / "metrics.jsonl", "loss")
    assert curve == ([1, 2, 3, 4], [10.0, 2.0, 3.0, 4.0])
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_a_resume_keeps_each_step_once(tmp_path):
    """The loop passes the step it resumes from: rows past it (and torn lines) are dropped."""
    with MetricsLogger(str(tmp_path), log_freq=1, total_steps=4, progress_bar=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, step_metrics(step))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # killed mid-write
    with MetricsLogger(
        str(tmp_path), log_freq=1, total_steps=4, progress_bar=False, keep_through=1
    ) as logger:
        for step in (2, 3, 4):
            logger.log(step, step_metrics(step, loss=float(step)))
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 10.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]


def test_plot_loss_off_draws_no_plot(tmp_path):
    with MetricsLogger(
        str(tmp_path), log_freq=1, total_steps=2, progress_bar=False, plot_loss=False
    ) as logger:
        for step in (1, 2):
            logger.log(step, step_metrics(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def read_tensorboard_tags(folder: Path) -> set[str]:
    (events,) = folder.glob("events.out.tfevents.*")
    data, tags = events.read_bytes(), set()
    offset = 0
    while offset < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
        tags |= {value.tag for value in event.summary.value}
        offset += 12 + length + 4
    return tags


def test_tensorboard_scalars(tmp_path):
    with MetricsLogger(str(tmp_path), 1, 2, enable_tensorboard=True, progress_bar=False) as logger:
        logger.log(1, step_metrics(1))
        logger.log(2, step_metrics(2, grad_norm=float("nan")))
    assert read_tensorboard_tags(tmp_path / "tb") == {
        "loss_metrics/global_avg_loss",
        "grad_norm",
        "lr",
        "throughput/tokens_per_sec",
        "mfu_pct",
        "time/step_time_s",
        "memory/peak_gib",
    }


def test_progress_bar_and_info(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), log_freq=2, total_steps=4)
    assert [logger.should_log(s) for s in (1, 2, 3, 4)] == [True, True, False, True]
    logger.log(1, step_metrics(1))
    logger.advance(2)
    logger.info("checkpoint saved")
    logger.log(4, step_metrics(4))
    assert logger._bar.n == 4
    logger.close()
    out, err = capsys.readouterr()
    assert "checkpoint saved" in out
    assert "4/4" in err and "loss=2.5000" in err and "mfu%=12.5" in err
    # One plain line per logged step, on stdout, bar or no bar.
    assert "step 4/4  loss 2.5000  grad_norm 1.000  lr 3.00e-04  tokens/s 250  mfu 12.5%" in out


def test_log_lines_without_bar_and_nulls_for_unmeasured(tmp_path, capsys):
    with MetricsLogger(str(tmp_path), log_freq=10, total_steps=20, progress_bar=False) as logger:
        logger.log(
            1,
            step_metrics(
                1, tokens_per_sec=None, mfu_pct=None, step_time_s=None, memory_in_use_gib=1.0
            ),
        )
        logger.advance(2, loss=4.5)
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "step  1/20  loss 10.0000  grad_norm 1.000  lr 3.00e-04  tokens/s -  mfu -  "
        "step_time -  memory 1.25 GiB peak / 1.00 GiB in use"
    ]
    assert err == ""
    (line,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert line["tokens_per_sec"] is None and line["mfu_pct"] is None
    assert line["step_time_s"] is None


def test_bar_shows_the_loss_of_every_step(tmp_path):
    logger = MetricsLogger(str(tmp_path), log_freq=10, total_steps=20)
    logger.log(1, step_metrics(1))
    logger.advance(2, loss=4.25)
    assert logger._bar.postfix.startswith("loss=4.2500")
    assert "tok/s=250" in logger._bar.postfix  # the last logged throughput stays
    logger.close()


def test_header_file(tmp_path):
    with MetricsLogger(str(tmp_path), 1, 1, progress_bar=False) as logger:
        logger.write_header({"peak_flops_method": "measured"})
    assert json.loads((tmp_path / "metrics_header.json").read_text()) == {
        "peak_flops_method": "measured"
    }


def test_unwritable_metrics_file_names_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a file where a folder should be: fails for root too, unlike chmod
    with pytest.raises(MetricsFileError, match=r"a_file/run/metrics.jsonl cannot be written"):
        MetricsLogger(str(blocker / "run"), log_freq=1, total_steps=1)


def test_non_main_process_writes_nothing(tmp_path):
    folder = tmp_path / "run"
    logger = MetricsLogger(str(folder), 1, 2, enable_tensorboard=True, is_main_process=False)
    logger.log(1, step_metrics(1))
    logger.advance(2)
    logger.info("ignored")
    logger.close()
    assert not folder.exists()


def test_log_freq_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="log_freq=0"):
        MetricsLogger(str(tmp_path), log_freq=0, total_steps=1)


class FakeWandb:
    """Stands in for the wandb module: records what a run was given."""

    def __init__(self):
        self.init_kwargs, self.logged, self.finished = None, [], False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, scalars, step):
        self.logged.append((step, scalars))

    def finish(self):
        self.finished = True


def test_wandb_sink_gets_tagged_scalars(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    with MetricsLogger(
        str(tmp_path),
        1,
        2,
        progress_bar=False,
        enable_wandb=True,
        run_config={"training": {"steps": 2}},
    ) as logger:
        logger.log(1, step_metrics(1, tokens_per_sec=None))
        logger.log(2, {"loss": 3.0, "val_loss": 2.0, "val_perplexity": 7.39})
    assert fake.init_kwargs == {
        "project": "proj",
        "dir": str(tmp_path),
        "config": {"training": {"steps": 2}},
        "name": tmp_path.name,
    }
    step, scalars = fake.logged[0]
    assert step == 1 and scalars["loss_metrics/global_avg_loss"] == 10.0
    assert "throughput/tokens_per_sec" not in scalars  # null: not sent
    assert fake.logged[1] == (
        2,
        {
            "loss_metrics/global_avg_loss": 3.0,
            "validation_metrics/loss": 2.0,
            "validation_metrics/perplexity": 7.39,
        },
    )
    assert fake.finished


def test_wandb_missing_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ValueError, match=r"metrics.enable_wandb=true needs the wandb package"):
        MetricsLogger(str(tmp_path), 1, 1, enable_wandb=True)
