"""Tests for titan_jax/train/profiling.py: which steps are traced, and that a trace is written."""

import jax
import pytest
from cli_args import QUIET_METRICS
from tiny_model import TINY

from titan_jax.config import load_config
from titan_jax.train import loop, profiling
from titan_jax.train.profiling import StepProfiler


def config(folder, *overrides):
    return load_config(
        None,
        [
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "1",
            "--training.steps",
            "4",
            "--lr_scheduler.warmup_steps",
            "1",
            *QUIET_METRICS,
            "--profiling.enable_profiling",
            "true",
            *overrides,
        ],
    )


def test_traces_the_last_profile_steps_of_every_window(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(
        profiling.jax.profiler, "start_trace", lambda folder, **kw: events.append(("start", folder))
    )
    monkeypatch.setattr(profiling.jax.profiler, "stop_trace", lambda: events.append(("stop",)))
    cfg = config(tmp_path, "--profiling.profile_freq", "3", "--profiling.profile_steps", "2")
    with StepProfiler(cfg) as profiler:
        for step in range(1, 9):
            profiler.before_step(step)
            events.append(step)
            profiler.after_step(step, None)
    folder = tmp_path / "profile"
    assert events == [
        1,
        ("start", str(folder / "iteration_3")),
        2,
        3,
        ("stop",),
        4,
        ("start", str(folder / "iteration_6")),
        5,
        6,
        ("stop",),
        7,
        ("start", str(folder / "iteration_9")),
        8,
        ("stop",),
    ]  # closed on exit


def test_disabled_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling.jax.profiler, "start_trace", pytest.fail)
    profiler = StepProfiler(config(tmp_path, "--profiling.enable_profiling", "false"))
    for step in range(1, 12):
        profiler.before_step(step)
        profiler.after_step(step, None)


def test_training_writes_a_trace(tmp_path, capsys):
    loop.train(
        config(tmp_path, "--profiling.profile_freq", "2"), jax.devices()[:1], model_args=TINY
    )
    for step in (2, 4):
        traces = list((tmp_path / "profile" / f"iteration_{step}").rglob("*.xplane.pb"))
        assert traces and traces[0].stat().st_size > 0
    assert list((tmp_path / "profile" / "iteration_2").rglob("*.trace.json.gz"))  # Perfetto
    assert "profile of steps up to 2 written to" in capsys.readouterr().out
