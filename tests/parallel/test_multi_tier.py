"""Multi-tier checkpoints across real processes (titan_jax/train/local_tier.py): a job of 2
`titan-jax train` processes on 127.0.0.1, each one data-parallel replica sharded over its own
2 devices, saves a local tier between its persistent saves; process 1 is killed (SIGKILL) after
a local save newer than the last persistent one and its local folder wiped (a replaced host);
the restart of every process resumes from that local step, process 1 reading its shards from
its peer in the other replica, and trains on bitwise like a run that was never interrupted
(fp32). (A resume on another number of processes: `test_multihost.py`.) Slow."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from cli_args import QUIET_METRICS

from tests.parallel.test_distributed import _free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS, INTERVAL, LOCAL_INTERVAL = 6, 3, 2  # persistent saves at 3 and 6, local at 2 and 4
KILLED_AFTER = 4  # the local save the kill follows: newer than persistent step 3
PROCESSES = 2  # one replica each, its state sharded over the process's 2 devices (fsdp 2)
pytestmark = pytest.mark.slow


def _train(
    dump: Path, local: Path | None, port: int, i: int, processes: int, steps: int = STEPS
) -> subprocess.Popen:
    argv = [
        *("-m", "titan_jax.cli", "train", "--config", str(ROOT / "configs" / "qwen3_debug.toml")),
        *("--job.dump_folder", str(dump), "--job.cpu_devices", "2"),
        *("--training.steps", str(steps), "--training.seq_len", "32"),
        *("--training.local_batch_size", "1", "--lr_scheduler.warmup_steps", "2"),
        *("--metrics.log_freq", "1", *QUIET_METRICS),
        *("--metrics.peak_flops", "1e12", "--validation.enable", "false"),
        *("--parallelism.data_parallel_replicate_degree", "2"),
        *("--checkpoint.enable", "true", "--checkpoint.interval", str(INTERVAL)),
        *("--checkpoint.last_save_model_only", "false"),
        *("--distributed.num_processes", str(processes), "--distributed.process_id", str(i)),
        *("--distributed.coordinator_address", f"127.0.0.1:{port}"),
        *("--distributed.heartbeat_timeout", "5"),
    ]
    if local is not None:
        argv += ["--checkpoint.local_folder", str(local)]
        argv += ["--checkpoint.local_interval", str(LOCAL_INTERVAL)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _job(
    dump: Path, local: Path | None, processes: int, steps: int = STEPS
) -> list[subprocess.Popen]:
    port = _free_port()
    return [_train(dump, local, port, i, processes, steps) for i in range(processes)]


@pytest.fixture(scope="module")
def uninterrupted(module_tmp_path) -> Path:
    """The job without a kill or a local tier (saves change no number), run once."""
    run = module_tmp_path / "uninterrupted"
    _finish(_job(run, None, PROCESSES))
    return run


def _finish(procs: list[subprocess.Popen]) -> str:
    """Waits for every process; returns process 0's stdout."""
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outs[0][1][-3000:]
    return outs[0][0]


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").open())}


def _final_state(dump: Path) -> dict[str, np.ndarray]:
    path = dump / "checkpoint" / str(STEPS) / "state"
    tree = ocp.PyTreeCheckpointHandler().metadata(path).tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = ocp.PyTreeCheckpointer().restore(path, restore_args=args)
    return {k: np.asarray(v) for k, v in ocp.tree.to_flat_dict(restored, sep=".").items()}


def test_a_killed_process_with_a_wiped_local_tier_resumes_bitwise_from_its_peer(
    uninterrupted, tmp_path
):
    """A replica a process: the killed one's peer holds its shards in the other replica."""
    processes = PROCESSES
    ref = uninterrupted

    dump, local = tmp_path / "run", tmp_path / "local"
    procs = _job(dump, local, processes)
    try:
        for line in procs[0].stdout:
            if f"local checkpoint step {KILLED_AFTER}:" in line:
                break
        else:
            raise AssertionError(procs[0].stderr.read()[-3000:])
        os.kill(procs[1].pid, signal.SIGKILL)
        for p in procs:
            p.communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[1].returncode == -signal.SIGKILL
    assert sorted(p.name for p in (dump / "checkpoint").iterdir() if p.name.isdigit()) == [
        str(INTERVAL)
    ]
    (wiped,) = local.glob("*/process_1")
    shutil.rmtree(wiped)

    out = _finish(_job(dump, local, processes))
    assert (
        f"resuming at step {KILLED_AFTER + 1} from local checkpoint step {KILLED_AFTER} in "
        f"{local} (process 1: shards fetched from a peer)" in out
    ), out
    before, after = _losses(ref), _losses(dump)
    assert sorted(after) == list(range(1, STEPS + 1))
    assert after == before  # 5 and 6 trained after the restore: bitwise
    expected, got = _final_state(ref), _final_state(dump)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
