"""Where a process's wall time goes: each second in one category, recorded in goodput.jsonl.

The categories are ml-goodput-measurement's (Google's goodput library, which reads its events
from Cloud Logging): `CATEGORIES` maps each to its name there. The host loop is always in one
phase (`GoodputRecorder.phase`): reading a batch, dispatching a step (where the first call
traces and compiles it), validating, saving, or anything else. A phase's seconds are split by
what the devices did meanwhile: while a dispatched step is still running, the time is step
time (so a batch read while the devices compute costs nothing); once every dispatched step has
finished, it is the phase's own category. A watcher thread notes when each step finishes
(`_FinishTimes`), since the loop reads a step's metrics only one step later.

Process 0 appends to `{job.dump_folder}/goodput.jsonl` (never truncated by a resume, unlike
metrics.jsonl):

    {"event": "start", "lifetime": 2, "pid": ..., "process_start": t0, "time": t, "step": 4,
     "startup_s": ..., "checkpoint_restore_s": ...}       startup; the step it starts after
    {"event": "interval", "lifetime": 2, "time": t, "steps": [5, 6], "step_s": ..., ...}
    {"event": "end", "lifetime": 2, "time": t, "steps": [...], "reason": "finished", ...}

Each record holds the seconds since the one before (`{category}_s`, zero ones left out; times
are Unix seconds); interval records are written at every logged step and before every
checkpoint save, so that a resume point is a record boundary. Which step time was productive
and which was recomputed after a restart is decided when the records are read
(`goodput_summary.py`); a process killed without an end record counts from its last record to
the next process's start as a pause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import jax

RECORD_FILE = "goodput.jsonl"

# category -> (what it is, its name in ml-goodput-measurement). `productive` and `recomputed`
# are recorded together as `step` and told apart when the records are read.
CATEGORIES: dict[str, tuple[str, str]] = {
    "productive": ("steps whose results the run kept", "GoodputType.TOTAL"),
    "startup": (
        "process start to the first step, less the restore: imports, joining the job, "
        "building the trainer and its state, opening the data",
        "TPU_INITIALIZATION + TRAINING_PREP",
    ),
    "checkpoint_restore": (
        "reading the checkpoint or weights a process starts from",
        "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    ),
    "compilation": ("devices idle while the host traces and compiles the step", "PROGRAM_STARTUP"),
    "data_loading": ("devices idle while the host reads a batch", "DATA_LOADING_SYNC"),
    "checkpoint_save": (
        "devices idle while a checkpoint save blocks",
        "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    ),
    "evaluation": ("validation", "CUSTOM_BADPUT_EVENTS"),
    "recomputed": (
        "steps trained again after a restart: those done after the checkpoint the "
        "next process resumed from",
        "WASTED_PROGRESS_FROM_DISRUPTION",
    ),
    "pause": (
        "from a process's last record to the next process's start (a kill, the wait for a restart)",
        "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    ),
    "other": ("devices idle while the host logs, exports or finishes", "OTHER"),
}
STEP = "step"  # the recorded name of productive + recomputed device time
PHASES = (
    "startup",
    "checkpoint_restore",
    "compilation",
    "data_loading",
    "checkpoint_save",
    "evaluation",
    "other",
)


def process_start_time() -> float:
    """When this process started (Unix seconds, to a clock tick): its start in /proc counts
    from boot, as CLOCK_BOOTTIME does (/proc/stat's boot time is whole seconds). Now, off
    Linux."""
    try:
        with open("/proc/self/stat") as f:  # the command name may hold spaces: split after it
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


@dataclasses.dataclass
class _Finish:
    at: float | None = None  # time.monotonic() when the step's outputs were ready


class _FinishTimes:
    """A daemon thread that waits on each dispatched step's metrics and notes when they are
    ready (a daemon: a step stuck in a collective must not hold the process at exit)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, _Finish]] = queue.SimpleQueue()
        threading.Thread(target=self._wait, daemon=True, name="titan-jax-goodput").start()

    def watch(self, outputs: Any) -> _Finish:
        finish = _Finish()
        self._queue.put((outputs, finish))
        return finish

    def _wait(self) -> None:
        while True:
            outputs, finish = self._queue.get()
            with contextlib.suppress(Exception):  # a failed step ends its wait too
                jax.block_until_ready(outputs)
            finish.at = time.monotonic()


def _lifetimes_so_far(path: Path) -> int:
    count = 0
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                count = max(count, int(json.loads(line)["lifetime"]))
            except (ValueError, KeyError, TypeError):  # torn by a crash
                continue
    return count


class GoodputRecorder:
    """Context manager timing one process's run; records only on the main process.

    `started_at`: when the process's startup began (Unix seconds; the CLI passes the process
    start). `run_folder`: as the user named it, for the hint in the closing line."""

    def __init__(self, enabled: bool, started_at: float, run_folder: str):
        self.enabled, self.run_folder = enabled, run_folder
        self.process_start = started_at
        self._notify: Callable[[str], None] = print
        self._offset = time.time() - time.monotonic()  # monotonic -> Unix seconds
        self._base = self._phase = "startup"
        self._since = started_at - self._offset
        self._seconds: dict[str, float] = {}
        self._lifetime_seconds: dict[str, float] = {}
        self._in_flight: _Finish | None = None
        self._steps: list[int] = []  # the first and last step reported since the last record
        self._finishes = _FinishTimes() if enabled else None
        self._file: TextIO | None = None  # the records file, once started
        self.lifetime = 0
        self.ending = "finished"  # or the signal that stopped the run

    # Timing.

    def _split(self) -> None:
        """Books the time since the last split: step time while a dispatched step runs, the
        phase's own after that."""
        now = time.monotonic()
        spent = now - self._since
        idle = spent
        if self._in_flight is not None:
            done = self._in_flight.at
            idle = 0.0 if done is None else max(0.0, now - max(self._since, done))
        for key, seconds in ((self._phase, idle), (STEP, spent - idle)):
            if seconds > 0:
                self._seconds[key] = self._seconds.get(key, 0.0) + seconds
        self._since = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The time inside the block is `name`'s (or step time while a step runs)."""
        assert name in PHASES, name
        if not self.enabled:
            yield
            return
        self._split()
        outer, self._phase = self._phase, name
        try:
            yield
        finally:
            self._split()
            self._phase = outer

    def dispatched(self, outputs: Any) -> None:
        """A step was dispatched: until `outputs` are ready, the devices are busy with it."""
        if self._finishes is not None:  # enabled
            self._split()
            self._in_flight = self._finishes.watch(outputs)

    def reported(self, step: int) -> None:
        """`step`'s metrics were read."""
        if self.enabled:
            self._steps = [self._steps[0] if self._steps else step, step]

    # Records.

    def started(self, folder: Path, step: int, notify: Callable[[str], None]) -> None:
        """Opens `folder/goodput.jsonl` (under the run's lock) and records the startup of a
        process that starts after `step`; `notify` prints the closing line (the run's log)."""
        if not self.enabled:
            return
        self._notify = notify
        path = folder / RECORD_FILE
        self.lifetime = _lifetimes_so_far(path) + 1
        torn = path.is_file() and not path.read_bytes().endswith(b"\n") and path.stat().st_size
        self._file = open(path, "a", buffering=1)  # line-buffered: a kill loses no whole line
        if torn:
            self._file.write("\n")
        self._write(
            "start",
            {"pid": os.getpid(), "process_start": round(self.process_start, 3), "step": step},
        )

    def training(self) -> None:
        """The step loop begins: host time outside a phase is `other` from now on."""
        if self.enabled:
            self._split()
            self._base = self._phase = "other"

    def interval(self) -> None:
        """Records the time since the last record, if a step was reported since (at logged
        steps and before saves)."""
        if self.enabled and self._file is not None and self._steps:
            self._write("interval")

    def _write(self, event: str, extra: dict[str, Any] | None = None) -> None:
        if self._file is None:
            raise RuntimeError(f"goodput {event!r} record before its file was opened")
        self._split()
        record: dict[str, Any] = {
            "event": event,
            "lifetime": self.lifetime,
            "time": round(self._since + self._offset, 3),
            **(extra or {}),
        }
        if self._steps:
            record["steps"] = self._steps
        record.update({f"{k}_s": round(v, 4) for k, v in self._seconds.items() if round(v, 4)})
        self._file.write(json.dumps(record) + "\n")
        for k, v in self._seconds.items():
            self._lifetime_seconds[k] = self._lifetime_seconds.get(k, 0.0) + v
        self._seconds, self._steps = {}, []

    def __enter__(self) -> GoodputRecorder:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._file is None:
            return
        self._phase = self._base  # an error may leave a phase unclosed
        self._write("end", {"reason": self.ending if kind is None else "error"})
        self._file.close()
        self._file = None
        if kind is None:
            self._notify(self.line())

    def line(self) -> str:
        """This process's split, as one log line."""
        seconds = self._lifetime_seconds
        total = sum(seconds.values())
        parts = ", ".join(
            f"{k.replace('_', ' ')} {v:.1f} s"
            for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])
            if v >= 0.05
        )
        return (
            f"time of this process: {total:.1f} s, {100 * seconds.get(STEP, 0.0) / total:.1f}"
            f"% in steps ({parts}); goodput across restarts: titan-jax goodput "
            f"{shlex.quote(self.run_folder)}"
        )
