"""What ends a run before its last step, and how each ends it.

- A signal (`StopSignals`): SIGTERM or SIGINT finishes the current step, saves it and returns.
- A hang (`StepWatchdog`): a step that never finishes (a stuck collective, a dead host, a wedged
  device) ends the job. The host loop beats once per finished step; a watcher thread ends the
  process when no beat came for `distributed.step_timeout` seconds, as TorchTitan's
  communication timeouts do. The main thread is then blocked inside XLA, where no Python
  exception reaches it: the job is ended from the watcher (`parallel.distributed.exit_job`),
  after telling the other processes. Work that is not a step (compiling, validating, saving)
  runs `paused()`, and watching starts only after the first step, which compiles. `activity()`
  says what the loop is doing, for the heartbeat the other processes read
  (`parallel.distributed.JobFailures`), which names it when this process falls silent.
- Bad steps (`BadSteps`): a non-finite step is skipped by the step's finite guard (the state
  stays as it was) and counted; `training.max_consecutive_bad_steps` in a row stop the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils


class StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step (and save it).

    One process: the handler sets a flag. Several processes must all stop at the same step, so
    there SIGTERM is left to JAX's preemption service (which `jax.distributed.initialize`
    installs, and which picks a step every process reaches) and a Ctrl-C is forwarded to it as
    SIGTERM. A second signal of the kind takes its default action (SIG_DFL): Ctrl-C twice
    quits at once, even inside a compiled step or a checkpoint wait, where Python's own
    KeyboardInterrupt would wait for the call to return. What the kill leaves is what kill -9
    leaves: the last finished checkpoint, from which the same command resumes.
    """

    def __init__(self, notify: Callable[[str], None]):
        self.received: str | None = None
        self._notify = notify
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            multi = jax.process_count() > 1
            for sig in (signal.SIGINT,) if multi else (signal.SIGINT, signal.SIGTERM):
                previous = signal.signal(sig, self._handle)
                self._previous[sig] = signal.SIG_DFL if previous is None else previous
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)  # __exit__ still puts the previous one back
        self._notify(
            f"{self.received} received: stopping after the current step and saving it "
            "(send it again to quit at once)"
        )
        if jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step`; every process must call this at every step."""
        if jax.process_count() == 1:
            return self.received is not None
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the preemption service is disabled: signals kill as usual
            return False

    @property
    def reason(self) -> str:
        return self.received or "preemption notice"


class StepWatchdog:
    """Context manager; `on_hang(message)` must end the process (tests pass a recorder)."""

    def __init__(self, timeout_s: float, on_hang: Callable[[str], None]):
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._lock = threading.Lock()
        self._since: float | None = None  # when the wait for the next step began; None: paused
        self._step: int | None = None  # the last finished step
        self._paused_for: str | None = None  # what the loop does meanwhile, when paused
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StepWatchdog:
        if self.timeout_s > 0:
            self._thread = threading.Thread(
                target=self._watch, daemon=True, name="titan-jax-step-watchdog"
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self, step: int) -> None:
        """`step` finished: the clock restarts for the next one."""
        with self._lock:
            self._step, self._since = step, time.monotonic()

    @contextlib.contextmanager
    def paused(self, doing: str) -> Iterator[None]:
        """Untimed work; `doing` says what it is ("saving checkpoint 6")."""
        with self._lock:
            since, self._since = self._since, None
            paused_for, self._paused_for = self._paused_for, doing
        try:
            yield
        finally:
            with self._lock:
                self._paused_for = paused_for
                if since is not None:
                    self._since = time.monotonic()

    def activity(self) -> str:
        """What the loop is doing, as "while ..." completes it."""
        with self._lock:
            if self._paused_for is not None:
                return self._paused_for
            if self._step is None:
                return "starting up (the first step compiles)"
            return f"training (step {self._step} finished)"

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            with self._lock:
                late = self._since is not None and time.monotonic() - self._since > self.timeout_s
                step = self._step or 0
            if late:
                self._on_hang(
                    f"no step finished within distributed.step_timeout={self.timeout_s:g} s "
                    f"after step {step} (a stuck collective, a dead host or a wedged device); "
                    "ending the job. Resume from its last checkpoint with the same command; "
                    "raise distributed.step_timeout if steps are this slow"
                )
                return


class BadStepsError(RuntimeError):
    """Too many non-finite steps in a row: the run stops instead of training on garbage."""


class BadSteps:
    """Counts non-finite steps in a row."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def record(self, step: int, values: dict[str, float]) -> str | None:
        """Counts `step`; returns the line to log for a skipped step (None for a good one)."""
        if values["finite"]:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        return (
            f"step {step}: non-finite loss={values['loss']} or grad_norm="
            f"{values['grad_norm']}; update skipped ({self.in_a_row} in a row)"
        )

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit

    def check(self, step: int) -> None:
        """Raises BadStepsError once `limit` steps in a row were bad."""
        if self.exhausted:
            raise BadStepsError(
                f"{self.in_a_row} non-finite steps in a row (training.max_consecutive_bad_steps="
                f"{self.limit}); stopping at step {step} without saving it"
            )
