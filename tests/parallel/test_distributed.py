"""`[distributed]`: when `jax.distributed.initialize` is called and with what; which rows of a
global batch a process reads; a coordinator that never answers, and one process's failure,
end the job with a message naming the cause (real processes, marked slow)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from tests.parallel.parallel_helpers import tiny_trainer
from titan_jax.config import load_config
from titan_jax.parallel import distributed
from titan_jax.parallel.batch_placement import held_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def calls(monkeypatch):
    """The keyword arguments of every jax.distributed.initialize call (none is made)."""
    made: list[dict] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: made.append(kw))
    for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES"):
        monkeypatch.delenv(name, raising=False)
    return made


def _distributed(*overrides: str):
    return load_config(None, list(overrides)).distributed


def test_cpu_runs_never_initialize_unless_told(calls, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert distributed.initialize_distributed(_distributed()) is False
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert (
        distributed.initialize_distributed(_distributed("--distributed.num_processes", "1"))
        is False
    )
    assert calls == []


def test_tpu_hosts_auto_detect_unless_the_environment_names_one_host(calls, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0")
    assert distributed.initialize_distributed(_distributed()) is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0,host-1")
    timeout = ["--distributed.initialization_timeout", "30"]
    assert distributed.initialize_distributed(_distributed(*timeout)) is True
    # No addresses: JAX's cluster detection fills them in; our deadlines fire before JAX's.
    assert len(calls) == 1
    assert set(calls[0]) == {"initialization_timeout", "heartbeat_timeout_seconds"}
    assert 30 < calls[0]["initialization_timeout"] <= 30 + distributed._GRACE_S
    assert calls[0]["heartbeat_timeout_seconds"] == 100 + distributed._GRACE_S


def test_explicit_fields_are_passed_through(calls, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    d = _distributed(
        "--distributed.num_processes",
        "4",
        "--distributed.process_id",
        "0",
        "--distributed.coordinator_address",
        "10.0.0.1:1234",
    )
    assert distributed.initialize_distributed(d) is True
    assert {k: v for k, v in calls[0].items() if k != "initialization_timeout"} == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 0,
        "heartbeat_timeout_seconds": 100 + distributed._GRACE_S,
    }


def test_rows_come_from_the_batch_sharding_not_the_process_index():
    trainer = tiny_trainer(
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "4",
        "--training.local_batch_size",
        "4",
    )
    devices = trainer.plan.mesh.devices.reshape(2, 4)  # (fsdp, tp)
    sharding = trainer.batches.sharding
    assert trainer.batches.rows() == list(range(8))  # one process holds every device
    # A host holding one fsdp rank's whole tp group reads that rank's rows ...
    assert held_rows(sharding, 8, list(devices[1])) == [4, 5, 6, 7]
    # ... and a host whose devices span both fsdp ranks (tp split across hosts) reads all 8,
    # where process_index arithmetic would give it half.
    assert held_rows(sharding, 8, [*devices[0, :2], *devices[1, :2]]) == list(range(8))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(process_id: int, port: int, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "titan_jax.cli",
            "train",
            "--config",
            str(ROOT / "configs" / "qwen3_debug.toml"),
            "--job.cpu_devices",
            "4",
            "--distributed.num_processes",
            "2",
            "--distributed.process_id",
            str(process_id),
            "--distributed.coordinator_address",
            f"127.0.0.1:{port}",
            *overrides,
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "process_id, message",
    [
        (
            1,
            "process 1 could not reach distributed.coordinator_address=127.0.0.1:{port} within "
            "distributed.initialization_timeout=2 s (is process 0 running there?)",
        ),
        (
            0,
            "process 0 of 2: not every process reached distributed.coordinator_address="
            "127.0.0.1:{port} within distributed.initialization_timeout=2 s; "
            "start the same command "
            "on every host, each with its own distributed.process_id",
        ),
    ],
)
def test_a_missing_coordinator_or_process_is_one_line_naming_the_fields(
    tmp_path, process_id, message
):
    port = _free_port()
    start = time.monotonic()
    proc = _cli(
        process_id,
        port,
        "--distributed.initialization_timeout",
        "2",
        "--job.dump_folder",
        str(tmp_path),
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1] == f"titan-jax: error: {message.format(port=port)}"
    assert time.monotonic() - start < 60  # the timeout, not JAX's default 300 s


@pytest.mark.slow
def test_one_process_failing_ends_the_job_with_its_message_on_process_0(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"paragraph {i} " + "word " * (i % 7 + 3) for i in range(50)))
    common = [
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "3",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        "--validation.enable",
        "false",
        "--checkpoint.enable",
        "false",
        "--training.dataset",
        "text",
        "--distributed.initialization_timeout",
        "120",
    ]
    port = _free_port()
    procs = [
        _cli(0, port, *common, "--training.dataset_path", str(text)),
        _cli(1, port, *common, "--training.dataset_path", str(tmp_path / "missing.txt")),
    ]
    (_, err0), (_, err1) = (p.communicate(timeout=300) for p in procs)
    missing = f"dataset_path='{tmp_path / 'missing.txt'}' does not exist"
    assert [p.returncode for p in procs] == [2, 2], (err0, err1)
    assert err1.strip().splitlines()[-1] == f"titan-jax: error: {missing}"
    assert err0.strip().splitlines()[-1] == f"titan-jax: error: process 1 of 2 failed: {missing}"


@pytest.mark.parametrize(
    "error, from_a_peer",
    [
        # jax 0.12 raises a gloo all-gather whose peer was killed as a ValueError (CI, 2026-12-05)
        (
            ValueError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Connection reset by peer"),
            True,
        ),
        (jax.errors.JaxRuntimeError("UNAVAILABLE: connection lost"), True),
        (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"), False),
        (ValueError("INVALID_ARGUMENT: shapes differ"), False),
        (ValueError("a setting is wrong"), False),
        (KeyError("UNKNOWN: not a runtime status"), False),
    ],
)
def test_a_collectives_transport_error_waits_for_the_watcher_whatever_its_type(error, from_a_peer):
    assert distributed._may_come_from_a_lost_process(error) is from_a_peer
