"""A process of a multi-process job that stops (SIGSTOP: what a host cut off from the network
looks like to the others) or is killed: the others end within `distributed.heartbeat_timeout`
with one line naming it and exit code 3 (titan_jax/parallel/distributed.py), and a restart of
every process resumes from the last checkpoint. Real processes on 127.0.0.1 (slow)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_args import QUIET_METRICS

from tests.parallel.test_distributed import _free_port
from titan_jax.parallel.distributed import EXIT_LOST_PROCESS

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 5  # distributed.heartbeat_timeout of these tests
MARGIN = 15  # for a loaded 2-core machine; JAX's own abort would come at TIMEOUT + 10
RESTART = (
    "Ending the job: end that process if it still runs, then start every process again "
    "with the same command; it resumes from the last checkpoint"
)
pytestmark = [pytest.mark.slow, pytest.mark.unoptimized_cpu_code]

# A job of two processes in a loop of collectives (gloo), as the train loop is in its steps;
# with "finish" first, process 1 leaves the job at once and process 0 some time later.
JOB = """
import sys, time
import numpy as np
import jax
from jax.experimental import multihost_utils
from titan_jax.config import load_config
from titan_jax.parallel.distributed import JobFailures, initialize_distributed
finish = sys.argv[1] == "finish"
d = load_config(None, sys.argv[2:]).distributed
initialize_distributed(d)
with JobFailures(d.heartbeat_timeout) as failures, failures.guard():
    failures.activity = lambda: "in the collectives loop"
    multihost_utils.sync_global_devices("up")
    print("up", flush=True)
    while not finish:
        multihost_utils.process_allgather(np.ones(4))
    if jax.process_index() == 0:
        time.sleep(d.heartbeat_timeout + 3)
print("left", flush=True)
"""


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        text=True,
        env={
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _distributed(port: int, i: int) -> list[str]:
    return [
        "--distributed.num_processes",
        "2",
        "--distributed.process_id",
        str(i),
        "--distributed.coordinator_address",
        f"127.0.0.1:{port}",
        "--distributed.heartbeat_timeout",
        str(TIMEOUT),
    ]


def _wait_for(proc: subprocess.Popen, text: str) -> list[str]:
    """Reads `proc`'s stdout up to a line holding `text`; returns the lines read."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"the process ended before printing {text!r}: {proc.stderr.read()}")


def _end_of(survivor: subprocess.Popen, since: float) -> tuple[str, float]:
    """The survivor's last stderr line and how long after `since` it exited."""
    _, err = survivor.communicate(timeout=TIMEOUT + 60)
    took = time.monotonic() - since
    assert survivor.returncode == EXIT_LOST_PROCESS, err
    return err.strip().splitlines()[-1], took


@pytest.mark.parametrize(
    "lost, sig",
    [(1, signal.SIGSTOP), (0, signal.SIGSTOP), (1, signal.SIGKILL)],
    ids=["stopped", "coordinator-stopped", "killed"],
)
def test_a_lost_process_ends_the_other_with_one_line_naming_it(lost, sig):
    port = _free_port()
    procs = [_start(["-c", JOB, "loop", *_distributed(port, i)]) for i in range(2)]
    try:
        for p in procs:
            _wait_for(p, "up")
        time.sleep(1)  # a heartbeat or two posted (one every 0.5 s)
        os.kill(procs[lost].pid, sig)
        since = time.monotonic()
        line, took = _end_of(procs[1 - lost], since)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert took < TIMEOUT + MARGIN
    if lost == 0:  # the coordinator: every call to its service goes unanswered
        assert line == (
            f"titan-jax: error: process 0 of 2 (the coordinator, 127.0.0.1:{port}) "
            f"did not answer for distributed.heartbeat_timeout={TIMEOUT} s while "
            "this process was in the collectives loop: it was stopped, killed or "
            f"cut off from the job. {RESTART}"
        )
    else:  # named by its heartbeat (a killed one's peer first sees a gloo error, held back)
        assert re.fullmatch(
            rf"titan-jax: error: process 1 of 2 \(host \S+ pid {procs[1].pid}\) sent no "
            rf"heartbeat for distributed.heartbeat_timeout={TIMEOUT} s while in the "
            rf"collectives loop: it was stopped, killed or cut off from the job. {RESTART}",
            line,
        ), line


def test_a_process_that_left_the_job_cleanly_is_not_lost():
    port = _free_port()
    procs = [_start(["-c", JOB, "finish", *_distributed(port, i)]) for i in range(2)]
    outs = [p.communicate(timeout=TIMEOUT + 60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("left" in out for out, _ in outs)


STEPS, INTERVAL = 6, 3
TRAIN = [
    "-m",
    "titan_jax.cli",
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
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    str(INTERVAL),
    "--checkpoint.last_save_model_only",
    "false",
    "--job.cpu_devices",
    "2",
]


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").open())}


def test_a_stopped_training_process_ends_the_job_and_a_restart_resumes(tmp_path):
    """2 processes x 2 devices: process 1 stops during step 6, after checkpoint 3; process 0
    ends; the restart resumes from checkpoint 3, and its steps 4 and 5 are the stopped run's,
    bitwise (fp32)."""
    dump = tmp_path / "run"
    port = _free_port()

    def train(i: int) -> subprocess.Popen:
        return _start([*TRAIN, "--job.dump_folder", str(dump), *_distributed(port, i)])

    procs = [train(0), train(1)]
    try:
        _wait_for(procs[0], f"step {STEPS - 1}/{STEPS}")  # step 6 is dispatched
        os.kill(procs[1].pid, signal.SIGSTOP)
        since = time.monotonic()
        line, took = _end_of(procs[0], since)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert took < TIMEOUT + MARGIN
    assert re.fullmatch(
        rf"titan-jax: error: process 1 of 2 \(host \S+ pid {procs[1].pid}\) sent no heartbeat "
        rf"for distributed.heartbeat_timeout={TIMEOUT} s while training \(step [45] finished\): "
        rf"it was stopped, killed or cut off from the job. {RESTART}",
        line,
    ), line
    before = _losses(dump)
    assert sorted(before) == list(range(1, STEPS))

    port = _free_port()
    procs = [train(0), train(1)]
    (out, err), _ = (p.communicate(timeout=600) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], err
    assert f"resuming at step {INTERVAL + 1} from checkpoint {dump}/checkpoint/{INTERVAL}" in out
    after = _losses(dump)
    assert sorted(after) == list(range(1, STEPS + 1))
    assert {s: after[s] for s in before} == before  # 1-3 kept, 4-5 recomputed: bitwise
