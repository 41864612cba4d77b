"""Two `titan-jax train` processes x 4 CPU devices (jax.distributed over 127.0.0.1), each
process a slice (`parallelism.num_slices`: FSDP spans the two over the stand-in for DCN),
against one process with 8 devices in one slice: the same recipe gives the same losses, each
process reads only the rows its devices hold, and checkpoints move between one process and two
on another device count (2 slices -> 1 and back)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_args import QUIET_METRICS

from tests.parallel.test_distributed import _free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
COMMON = [
    "train",
    "--config",
    str(ROOT / "configs" / "qwen3_debug.toml"),
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    *QUIET_METRICS,
    "--metrics.peak_flops",
    "1e12",
    "--validation.freq",
    str(STEPS),
    "--validation.steps",
    "1",
    "--validation.local_batch_size",
    "1",
    "--validation.seq_len",
    "32",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
    "--checkpoint.last_save_model_only",
    "false",
]
pytestmark = pytest.mark.slow


def train(dump: Path, processes: int, devices: int = 8) -> list[str]:
    """Runs the recipe in `dump` on `processes` sharing `devices` (default 1 x 8 or 2 x 4), a
    slice each; returns each one's stdout."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    port = _free_port()

    def distributed(i: int) -> list[str]:
        if processes == 1:
            return []
        return [
            "--parallelism.num_slices",
            str(processes),
            "--distributed.num_processes",
            str(processes),
            "--distributed.process_id",
            str(i),
            "--distributed.coordinator_address",
            f"127.0.0.1:{port}",
        ]

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "titan_jax.cli",
                *COMMON,
                "--job.dump_folder",
                str(dump),
                "--job.cpu_devices",
                str(devices // processes),
                *distributed(i),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
    return [out for out, _ in outs]


def metrics(dump: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in records}) == len(records)  # each step once: one writer
    return {r["step"]: r for r in records}


@pytest.fixture(scope="module")
def runs(module_tmp_path):
    root = module_tmp_path
    return {n: (root / f"p{n}", train(root / f"p{n}", n)) for n in (1, 2)}


def _losses(dump: Path, key: str = "loss") -> dict[int, float]:
    return {s: r[key] for s, r in metrics(dump).items() if r.get(key) is not None}


# What jax 0.12's gloo prints on each process, numbers written as #.
GLOO = "[Gloo] Rank # is connected to # peer ranks. Expected number of connected peer ranks is : #"


def _gloo_only(line: str) -> bool:
    """Whether `line` holds nothing but gloo's lines and pieces of its message (or blanks)."""
    return all(
        piece.startswith("[Gloo]") or re.sub(r"\d+", "#", piece).strip() in GLOO
        for piece in re.split(r"(?=\[Gloo\])", line)
    )


def test_two_processes_train_like_one_and_read_only_their_rows(runs):
    (single, _), (double, outs) = runs[1], runs[2]
    for key in ("loss", "val_loss"):
        assert _losses(double, key) == pytest.approx(_losses(single, key), rel=1e-6, abs=0)
    assert len(_losses(double)) == STEPS
    # Only process 0 prints (process 1's stdout holds at most the gloo library's own message,
    # which its threads sometimes write in pieces cut anywhere, or run together).
    assert "step 1/4" in outs[0]
    assert [line for line in outs[1].splitlines() if not _gloo_only(line)] == []
    # Each process read the windows of its own rows only: 4 rows in each of STEPS batches.
    line = (
        f"data: process 0 read rows 0-3 ({4 * STEPS} windows), process 1 read rows 4-7 "
        f"({4 * STEPS} windows)"
    )
    assert line in outs[0].splitlines()


@pytest.mark.parametrize("saved_by, resumed_by, devices", [(2, 1, 4), (1, 2, 4)])
def test_a_resume_on_another_shape_keeps_the_global_batch(
    runs, tmp_path, saved_by, resumed_by, devices
):
    """2 x 4 devices -> 1 x 4, and 1 x 8 -> 2 x 2: the checkpoint moves between one process and
    two, and the global batch of 8 rows, no longer one row per device, becomes 2 microbatches
    of 4 rows; the restore checks every array's checksum, and training goes on like the
    original (other reduction orders: not bitwise; the validation batch, a row a device, is
    another)."""
    source, _ = runs[saved_by]
    dump = tmp_path / "resumed"
    shutil.copytree(source, dump)
    shutil.rmtree(dump / "checkpoint" / str(STEPS))  # resume from step 2
    outs = train(dump, resumed_by, devices)
    assert re.search(r"resuming at step 3 from checkpoint \S+/checkpoint/2", outs[0])
    processes = lambda n: f"{n} process{'es' if n > 1 else ''}"  # noqa: E731
    line = (
        f"resuming on {processes(resumed_by)} x {devices // resumed_by} devices, the "
        f"checkpoint was saved on {processes(saved_by)} x {8 // saved_by}: global batch 8 "
        "kept as 2 microbatch(es) of 1 row(s) x 4 data-parallel ranks"
    )
    assert line in outs[0].splitlines(), outs[0]
    assert _losses(dump) == pytest.approx(_losses(source), rel=1e-5, abs=0)
