"""`titan-jax train` in real processes: FSDP over 8 simulated devices against 1 device.

Same recipe (debugmodel on the embedded corpus), same global batch of 8 sequences: the logged
losses must agree (fp32 on CPU, rel <= 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
COMMON = ["train", "--config", str(ROOT / "configs" / "qwen3_debug.toml"),
          "--training.steps", str(STEPS), "--training.seq_len", "32",
          "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2",
          "--metrics.log_freq", "1", "--metrics.progress_bar", "false",
          "--checkpoint.enable", "false"]


def train_losses(dump: Path, *overrides: str) -> list[float]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-m", "titan_jax.cli", *COMMON,
                    "--job.dump_folder", str(dump), *overrides],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=900)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    return [losses[step] for step in range(1, STEPS + 1)]


@pytest.mark.slow
def test_cli_fsdp8_trains_like_one_device(tmp_path):
    fsdp = train_losses(tmp_path / "fsdp8", "--job.cpu_devices", "8",
                        "--training.local_batch_size", "1",
                        "--parallelism.data_parallel_shard_degree", "8")
    single = train_losses(tmp_path / "single", "--job.cpu_devices", "1",
                          "--training.local_batch_size", "8")
    assert fsdp[-1] < fsdp[0]
    assert fsdp == pytest.approx(single, rel=1e-5, abs=0)
