"""A step that hangs ends the job with a message after `distributed.step_timeout`
(titan_jax/train/stopping.py), tested with faked hangs (the loop's own use of it:
tests/train/test_checkpoint.py, which shares its compiled tiny step); and what the watchdog
says the loop is doing, for the other processes' heartbeat watchers."""

import subprocess
import sys
import time

from titan_jax.train.stopping import StepWatchdog


def test_a_hung_step_ends_the_process_with_the_message():
    """The main thread blocked outside Python (as in a collective that never completes)."""
    script = (
        "import threading\n"
        "from titan_jax.parallel.distributed import exit_job\n"
        "from titan_jax.train.stopping import StepWatchdog\n"
        "with StepWatchdog(1, lambda m: exit_job(m, 1)) as w:\n"
        "    w.beat(7)\n"
        "    threading.Event().wait()  # hangs forever\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1].startswith(
        "titan-jax: error: no step finished within distributed.step_timeout=1 s after step 7"
    )
    assert time.monotonic() - start < 30


def test_paused_work_and_the_first_step_are_not_timed():
    hung = []
    with StepWatchdog(0.5, hung.append) as w:
        time.sleep(1.0)  # before the first beat: compiling
        w.beat(1)
        with w.paused("validating at step 1"):
            time.sleep(1.0)
        w.beat(2)
    assert hung == []


def test_the_activity_says_what_the_loop_does():
    """What another process's heartbeat watcher reports when this one falls silent."""
    w = StepWatchdog(0, lambda m: None)
    assert w.activity() == "starting up (the first step compiles)"
    w.beat(5)
    assert w.activity() == "training (step 5 finished)"
    with w.paused("saving checkpoint 6"):
        assert w.activity() == "saving checkpoint 6"
        with w.paused("finishing after step 6"):
            assert w.activity() == "finishing after step 6"
        assert w.activity() == "saving checkpoint 6"
    assert w.activity() == "training (step 5 finished)"
