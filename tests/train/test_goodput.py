"""Goodput: where a run's wall time went (train/goodput.py records it, goodput_summary.py reads
it), checked on hand-made records, on a real step overlapping host work, and on a real CLI run
killed with SIGKILL and restarted."""

import hashlib
import json
import os
import re
import signal
import time

import jax
import jax.numpy as jnp
import pytest
from tiny_model import TINY

from titan_jax.cli import main
from titan_jax.config import ConfigError, load_config
from titan_jax.train import loop
from titan_jax.train.goodput import CATEGORIES, RECORD_FILE, GoodputRecorder
from titan_jax.train.goodput_summary import read_records, summarize

T0 = 1_800_000_000.0


def _write(folder, records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RECORD_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_resume_moves_the_repeated_steps_to_recomputed_and_the_gap_to_pause(tmp_path):
    # Process 1 trains steps 1-6 (checkpoint at 4: a record boundary), is killed; process 2
    # resumes from 4 after a 30 s gap and finishes steps 5-8.
    _write(
        tmp_path,
        [
            {
                "event": "start",
                "lifetime": 1,
                "process_start": T0,
                "time": T0 + 10,
                "step": 0,
                "startup_s": 10.0,
            },
            {
                "event": "interval",
                "lifetime": 1,
                "time": T0 + 25,
                "steps": [1, 4],
                "step_s": 8.0,
                "compilation_s": 7.0,
            },
            {
                "event": "interval",
                "lifetime": 1,
                "time": T0 + 31,
                "steps": [5, 6],
                "checkpoint_save_s": 2.0,
                "step_s": 4.0,
            },
            "torn line of a kill",
            {"lifetime": 1},
            {
                "event": "start",
                "lifetime": 2,
                "process_start": T0 + 61,
                "time": T0 + 70,
                "step": 4,
                "startup_s": 8.0,
                "checkpoint_restore_s": 1.0,
            },
            {
                "event": "interval",
                "lifetime": 2,
                "time": T0 + 80,
                "steps": [5, 8],
                "step_s": 8.0,
                "data_loading_s": 2.0,
            },
            {"event": "end", "lifetime": 2, "time": T0 + 81, "reason": "finished", "other_s": 1.0},
        ],
    )
    summary = summarize(str(tmp_path), read_records(str(tmp_path)))
    first, second = summary.lifetimes
    assert (first.ended, first.steps, first.recomputed_steps) == ("killed", (1, 6), 2)
    assert first.seconds["recomputed"] == 4.0 and first.seconds["productive"] == 8.0
    assert (second.ended, second.steps, second.seconds["pause"]) == ("finished", (5, 8), 30.0)
    assert summary.total_s == 81.0  # first start to last record
    assert summary.seconds["productive"] == 16.0 and summary.goodput == pytest.approx(16 / 81)
    assert set(summary.seconds) == set(CATEGORIES)


def test_a_resume_inside_a_record_splits_it_by_steps(tmp_path):
    # load_step rolls back to step 2 of a record of steps 1-4: steps 3 and 4 are repeated.
    _write(
        tmp_path,
        [
            {"event": "start", "lifetime": 1, "process_start": T0, "time": T0 + 1, "step": 0},
            {"event": "interval", "lifetime": 1, "time": T0 + 9, "steps": [1, 4], "step_s": 8.0},
            {"event": "start", "lifetime": 2, "process_start": T0 + 9, "time": T0 + 10, "step": 2},
            {"event": "start", "lifetime": 3, "process_start": T0 + 10, "time": T0 + 11, "step": 0},
        ],
    )
    first, second, third = summarize("run", read_records(str(tmp_path))).lifetimes
    assert first.recomputed_steps == 4  # 2 when the second resumed, 2 more at the third
    assert first.seconds["recomputed"] == 8.0 and first.seconds["productive"] == 0.0


def test_host_work_while_a_step_runs_is_step_time(tmp_path):
    """A batch read while the devices compute costs nothing; one read after they finished is
    a data-loading wait."""
    x = jnp.ones((1024, 1024))
    work = jax.jit(lambda x: jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ x), x))
    work(x).block_until_ready()  # compiled
    started = time.time()
    with GoodputRecorder(True, started, str(tmp_path)) as goodput:
        goodput.started(tmp_path, 0, lambda line: None)
        goodput.training()
        out = work(x)
        goodput.dispatched(out)
        with goodput.phase("data_loading"):
            time.sleep(0.2)
        assert not out.is_ready()  # the step outlasted that read
        out.block_until_ready()
        time.sleep(0.05)  # the watcher notes the finish
        with goodput.phase("data_loading"):
            time.sleep(0.3)
        goodput.reported(1)
        goodput.interval()
    (life,) = summarize(str(tmp_path), read_records(str(tmp_path))).lifetimes
    seconds = life.seconds
    assert 0.29 <= seconds["data_loading"] < 0.4, seconds
    assert seconds["productive"] > 0.1, seconds
    assert life.total_s == pytest.approx(life.last_record - started, abs=2e-3)


def _snapshot(root):
    return {
        str(p.relative_to(root)): p.is_dir() or hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "missing",
            "TMP/nope is not a folder; give the job.dump_folder of a run of titan-jax train",
        ),
        ("file", "TMP/file is not a folder"),
        ("no records", "TMP/empty holds no goodput.jsonl: it is not the job.dump_folder of a run"),
        ("torn", "TMP/torn/goodput.jsonl holds no goodput records"),
    ],
)
def test_goodput_of_a_folder_without_records_is_one_line(tmp_path, capsys, case, message):
    (tmp_path / "file").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / RECORD_FILE).write_text('{"event": "start", "lifet\n[1, 2]\n')
    folder = {"missing": "nope", "file": "file", "no records": "empty", "torn": "torn"}[case]
    before = _snapshot(tmp_path)
    code = main(["goodput", str(tmp_path / folder), "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(
        f"titan-jax: error: {message.replace('TMP', str(tmp_path))}"
    ), err
    assert err.count("\n") == 1 and _snapshot(tmp_path) == before


def test_a_fresh_run_refuses_a_folder_holding_another_runs_goodput_records(tmp_path):
    _write(tmp_path, [{"event": "interval", "lifetime": 1, "time": T0, "steps": [1, 4]}])
    config = load_config(
        None,
        [
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "16",
            "--training.steps",
            "2",
            "--metrics.progress_bar",
            "false",
        ],
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"job.dump_folder={tmp_path} holds the goodput records of steps 1-4 (goodput.jsonl) "
            "of another run; this run starts at step 1 and would mix the two histories: use a "
            "new job.dump_folder, or move goodput.jsonl out of it"
        ),
    ):
        loop.train(config, jax.devices()[:1], model_args=TINY)


@pytest.mark.slow
def test_a_killed_and_restarted_run_accounts_for_its_wall_time(tmp_path, capsys):
    from tests.train.test_resume import ARGS, Run, _lines, _records, finalized

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    folder, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoint"
    args = [*ARGS, "--validation.enable", "false", "--training.steps", "8"]
    began = time.time()
    run = Run(env, folder, args=args)
    run.wait_for(
        lambda: ckpt.is_dir() and 4 in finalized(ckpt) and 5 in run.losses(),
        "checkpoint 4 and step 5",
    )
    run.signal(signal.SIGKILL)
    killed = time.time()
    saved = finalized(ckpt)[-1]
    logged = max(r["step"] for r in _records(_lines(folder / "metrics.jsonl")))
    recorded = max(r["steps"][1] for r in _records(_lines(folder / RECORD_FILE)) if "steps" in r)
    assert recorded in (logged, logged - 1)  # the kill may fall between the two lines
    time.sleep(2)  # a pause before the restart
    out = Run(env, folder, args=args).finish()
    ended = time.time()
    assert re.search(
        r"time of this process: [\d.]+ s, [\d.]+% in steps \(.*\); goodput across "
        f"restarts: titan-jax goodput {folder}",
        out,
    ), out

    assert main(["goodput", str(folder), "--json", str(tmp_path / "goodput.json")]) == 0
    table = capsys.readouterr().out
    report = json.loads((tmp_path / "goodput.json").read_text())
    first, second = report["lifetimes"]
    assert (first["ended"], second["ended"]) == ("killed", "finished")
    assert first["steps"] == [1, recorded] and second["steps"] == [saved + 1, 8]
    assert first["recomputed_steps"] == recorded - saved > 0 and second["recomputed_steps"] == 0
    assert second["start_step"] == saved
    seconds = report["seconds"]
    assert sum(seconds.values()) == pytest.approx(report["total_s"], abs=1e-3)
    # From the first process's start to the last record: inside the test's own clock, less the
    # second process's exit (closing the logs, drawing loss.png).
    assert ended - began - 15 < report["total_s"] <= ended - began + 0.1
    assert seconds["pause"] >= 2 and second["seconds"]["pause"] == seconds["pause"]
    assert seconds["pause"] < time.time() - killed
    for key in (
        "productive",
        "startup",
        "compilation",
        "checkpoint_save",
        "recomputed",
        "checkpoint_restore",
    ):
        assert seconds[key] > 0, key
    assert 0 < report["goodput"] < 1
    assert re.search(
        rf"^1 .* 1-{recorded} .* {recorded - saved} \([\d.]+ s\) .* killed$", table, re.M
    ), table
    assert re.search(rf"^2 .* {saved + 1}-8 .* finished$", table, re.M), table
