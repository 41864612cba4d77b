"""A step that never finishes (a stuck collective, a dead host, a wedged device) ends the job.

The host loop beats once per finished step; a watcher thread ends the process when no beat
came for `distributed.step_timeout` seconds, as TorchTitan's communication timeouts do. The
main thread is then blocked inside XLA, where no Python exception reaches it: the job is ended
from the watcher (`parallel.distributed.exit_job`), after telling the other processes. Work
that is not a step (compiling, validating, saving) runs `paused()`, and watching starts only
after the first step, which compiles.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class StepWatchdog:
    """Context manager; `on_hang(message)` must end the process (tests pass a recorder)."""

    def __init__(self, timeout_s: float, on_hang: Callable[[str], None]):
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._lock = threading.Lock()
        self._since: float | None = None  # when the wait for the next step began; None: paused
        self._step = 0  # the last finished step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StepWatchdog:
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="titan-jax-step-watchdog")
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
    def paused(self) -> Iterator[None]:
        with self._lock:
            since, self._since = self._since, None
        try:
            yield
        finally:
            with self._lock:
                if since is not None:
                    self._since = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            with self._lock:
                late = self._since is not None and time.monotonic() - self._since > self.timeout_s
                step = self._step
            if late:
                self._on_hang(
                    f"no step finished within distributed.step_timeout={self.timeout_s:g} s "
                    f"after step {step} (a stuck collective, a dead host or a wedged device); "
                    "ending the job. Resume from its last checkpoint with the same command; "
                    "raise distributed.step_timeout if steps are this slow")
                return
