"""Stopping a run cleanly: SIGTERM or SIGINT finishes the current step, saves it and returns."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils


class StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step (and save it).

    One process: the handler sets a flag. Several processes must all stop at the same step, so
    there SIGTERM is left to JAX's preemption service (which `jax.distributed.initialize`
    installs, and which picks a step every process reaches) and a Ctrl-C is forwarded to it as
    SIGTERM. A second signal gets the previous handler: Ctrl-C twice quits at once.
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
        signal.signal(signum, self._previous.pop(signum))
        self._notify(f"{self.received} received: stopping after the current step and saving it "
                     "(send it again to quit at once)")
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
