"""Multi-process runs: `jax.distributed.initialize` from `[distributed]`, and a job-wide failure
channel so that one process's error, or its silence, ends every process of the job with one line
that names it.

Both sides of a failure are handled here because JAX alone handles neither well: a coordinator
that never answers, or a process that never arrives, aborts the waiting processes from C++
("Terminating process because the JAX distributed service detected fatal errors") with no
word of the setting to fix; and a process that dies mid-run leaves the others blocked in a
collective until a transport timeout, with a message about the transport, not the cause.
JAX's coordination service does notice a process that stops sending heartbeats, but it then
aborts every process with a C++ stack trace (exit 134), and jaxlib 0.12 cannot hand that
status to a Python callback (its `missed_heartbeat_callback` dies in `std::bad_cast`). So the
job posts heartbeats of its own through the service's key-value store, naming the host and
what the process is doing, and notices a silent process first; JAX's own timeout is set a
grace period later, as the backstop.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import jax

from titan_jax.config_schema import AUTO, Distributed
from titan_jax.errors import TitanJaxError
from titan_jax.jax_platform import is_tpu_host

# JAX's own connect deadline is ours plus this, so ours fires first with a message to act on.
_GRACE_S = 10
_FAILED_KEY = "titan_jax/failed/"  # + process index -> "exit code\nthe line to print"
# + process index + "/beat" -> "count\nhost and pid\nactivity", or _DONE (read as a folder, so
# that a process not yet heard of reads as empty rather than as an error)
_BEAT_KEY = "titan_jax/beat/"
_DONE = "done"  # posted by a process that left the job cleanly: no longer watched
EXIT_LOST_PROCESS = 3  # a process of the job stopped answering (docs/ERRORS.md)


class DistributedError(TitanJaxError):
    """The processes of a multi-process job could not start together."""


def exit_job(message: str, code: int) -> None:
    """Print `message` as the CLI prints an error and end this process at once (no cleanup:
    it is called from a watcher thread while the main thread may be blocked in C++)."""
    print(f"titan-jax: error: {message}", file=sys.stderr, flush=True)
    _exit_now(code)


def _tpu_env_names_one_host() -> bool:
    """A TPU environment that lists its hosts and lists one (then there is nothing to join)."""
    hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES")
    slices = int(os.environ.get("MEGASCALE_NUM_SLICES") or 1)
    return hosts is not None and "," not in hosts and slices == 1


def _wait_for_coordinator(d: Distributed, deadline: float) -> None:
    host, _, port = d.coordinator_address.rpartition(":")
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"process {d.process_id} could not reach distributed.coordinator_address="
                    f"{d.coordinator_address} within distributed.initialization_timeout="
                    f"{d.initialization_timeout} s (is process 0 running there?)"
                ) from None
            time.sleep(0.2)


def initialize_distributed(d: Distributed) -> bool:
    """Joins the job described by `d` (call before JAX's backend starts); returns whether this
    is a multi-process run. Raises DistributedError, or exits (code 2) with one line naming
    `distributed.*`, when the processes do not all meet within the timeout."""
    if jax.distributed.is_initialized():
        return True
    if d.num_processes == 1 or (
        d.num_processes == AUTO and (not is_tpu_host() or _tpu_env_names_one_host())
    ):
        return False
    deadline = time.monotonic() + d.initialization_timeout
    if d.num_processes == AUTO:  # a TPU cluster: JAX reads the hosts from its environment
        kwargs: dict = {}
        who, hint = "this process", "start the same command on every host of the slice"
    else:
        kwargs = {
            "coordinator_address": d.coordinator_address,
            "num_processes": d.num_processes,
            "process_id": d.process_id,
        }
        who = f"process {d.process_id} of {d.num_processes}"
        hint = "start the same command on every host, each with its own distributed.process_id"
        if d.process_id != 0:
            _wait_for_coordinator(d, deadline)
    message = (
        f"{who}: not every process reached distributed.coordinator_address="
        f"{d.coordinator_address or '(auto-detected)'} within "
        f"distributed.initialization_timeout={d.initialization_timeout} s; {hint}"
    )
    remaining = max(deadline - time.monotonic(), 1.0)
    watchdog = threading.Timer(remaining, exit_job, (str(DistributedError(message)), 2))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            **kwargs,
            initialization_timeout=int(remaining) + _GRACE_S,
            heartbeat_timeout_seconds=d.heartbeat_timeout + _GRACE_S,
        )
    finally:
        watchdog.cancel()
    return True


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_code_and_message(error: BaseException) -> tuple[int, str]:
    if isinstance(error, KeyboardInterrupt):
        return 130, "interrupted"
    if isinstance(error, TitanJaxError):
        return 2, str(error)
    lines = str(error).strip().splitlines()
    return 1, f"{type(error).__name__}: {lines[0] if lines else ''}"


# Runtime errors a lost peer cannot cause: the program's own (its size, its operands).
_LOCAL_RUNTIME_ERRORS = ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNIMPLEMENTED")


# Status codes a collective's transport failure carries. jax raises some of them as ValueError
# (a gloo all-gather whose peer was killed: "UNKNOWN: Gloo AllGather failed: ... Connection
# reset by peer"), so the code is read from the message whatever the exception's type.
_TRANSPORT_STATUS_CODES = (
    "UNKNOWN:",
    "UNAVAILABLE:",
    "ABORTED:",
    "DEADLINE_EXCEEDED:",
    "INTERNAL:",
)


def _may_come_from_a_lost_process(error: BaseException) -> bool:
    text = str(error)
    if isinstance(error, jax.errors.JaxRuntimeError):
        return not text.startswith(_LOCAL_RUNTIME_ERRORS)
    return isinstance(error, ValueError | RuntimeError) and text.startswith(_TRANSPORT_STATUS_CODES)


# Seconds past the heartbeat timeout a collective's error waits for the watcher to name a lost
# peer (JobFailures.report): under JAX's own abort, which comes _GRACE_S past it.
LOST_PROCESS_SLACK_S = _GRACE_S - 2.0


class JobFailures:
    """With several processes: a failure of this process is posted to JAX's coordination
    service (`report`, or an exception leaving a `guard()`), and a watcher thread ends this
    process with the first failure another process posted. One process: does nothing.

    The watcher also posts this process's heartbeat (a count, its host and `activity()`) and
    watches the next process's (a ring: each heartbeat is read once, whatever the job's size):
    one silent for `heartbeat_timeout` seconds is posted as lost, which ends every process
    with a line naming it (exit code `EXIT_LOST_PROCESS`). A coordination service that stops
    answering for as long (process 0 stopped or gone) ends the others the same way.
    """

    def __init__(self, heartbeat_timeout: float, poll_s: float = 0.5):
        self.heartbeat_timeout = heartbeat_timeout
        self.poll_s = min(poll_s, heartbeat_timeout / 10)
        self.activity: Callable[[], str] = lambda: "starting up"  # the run loop sets its own
        # JAX's coordination-service client once joined (`jax._src.distributed`'s, typed Any there).
        self._client: Any = None
        self._stop = threading.Event()
        self._reported: int | None = None  # the exit code of this process's own failure
        self._answered = time.monotonic()  # when the coordination service last answered
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> JobFailures:
        if jax.process_count() > 1:
            from jax._src.distributed import global_state  # the client JAX connected with

            self._client = global_state.client
            self._coordinator = global_state.coordinator_address
            watchers = [self._watch] + ([self._watch_coordinator] if jax.process_index() else [])
            self._threads = [
                threading.Thread(
                    target=target, daemon=True, name=f"titan-jax-{target.__name__[1:]}"
                )
                for target in watchers
            ]
            for thread in self._threads:
                thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if error is not None:
            self.report(error)
        self._stop.set()
        for thread in self._threads:
            thread.join()
        if self._client is not None and self._reported is None:  # left cleanly: stop watching
            with contextlib.suppress(Exception):
                self._client.key_value_set(
                    f"{self._beat_folder(jax.process_index())}beat", _DONE, allow_overwrite=True
                )
        if self._reported is not None:
            if jax.process_index() == 0:  # the service lives here: let the others read it first
                time.sleep(4 * self.poll_s)
            # JAX's own atexit would tell the coordination service this process shut down; the
            # others, ending on this failure, may have taken it down already, and that aborts
            # with a C++ trace under the message. Registered last, this runs first.
            atexit.register(_exit_now, self._reported)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Reports an exception as it leaves this block (before outer cleanups that may wait on
        the other processes, such as a checkpoint's finalize)."""
        try:
            yield
        except BaseException as e:
            self.report(e)
            raise

    def report(self, error: BaseException) -> None:
        """Tells the other processes that this one fails with `error` (first report only)."""
        if self._client is None or self._reported is not None:
            return
        if _may_come_from_a_lost_process(error):
            # A collective whose peer was killed fails here ("Connection reset by peer") before
            # that peer's heartbeat is missed; give the watcher the time to name it (it ends
            # this process), else this error is this process's own. The slack covers a loaded
            # host's late polls (a few seconds were not enough with 2 cores fully busy).
            time.sleep(self.heartbeat_timeout + LOST_PROCESS_SLACK_S)
        code, message = _exit_code_and_message(error)
        self._reported = code
        self._post(
            jax.process_index(),
            code,
            f"process {jax.process_index()} of {jax.process_count()} failed: {message}",
        )

    def _post(self, index: int, code: int, line: str) -> None:
        """Posts process `index`'s failure for every process to end with."""
        with contextlib.suppress(Exception):  # the service may be gone: JAX then ends the job
            self._client.key_value_set(
                f"{_FAILED_KEY}{index}", f"{code}\n{line}", allow_overwrite=True
            )

    @staticmethod
    def _beat_folder(index: int) -> str:
        return f"{_BEAT_KEY}{index}/"

    def _end(self, line: str, code: int) -> None:
        if jax.process_index() == 0:  # the service lives here: let the others read it first
            time.sleep(4 * self.poll_s)
        exit_job(line, code)

    def _watch(self) -> None:
        me = jax.process_index()
        watched = (me + 1) % jax.process_count()
        who = f"host {socket.gethostname()} pid {os.getpid()}"
        last, heard_at = "", time.monotonic()  # the watched process's last beat, when it came
        for beat in itertools.count(1):
            try:
                self._client.key_value_set(
                    f"{self._beat_folder(me)}beat",
                    f"{beat}\n{who}\n{self.activity()}",
                    allow_overwrite=True,
                )
                posted = self._client.key_value_dir_get(_FAILED_KEY)
                heard = self._client.key_value_dir_get(self._beat_folder(watched))
            except Exception:  # the service is gone: _watch_coordinator ends this process
                return
            self._answered = time.monotonic()
            value = heard[0][1] if heard else ""
            if value == _DONE or value != last:
                last, heard_at = value, time.monotonic()
            if self._reported is None:  # else this process is ending with its own failure
                if posted:
                    _, first = min(posted, key=lambda kv: int(kv[0].rsplit("/", 1)[-1]))
                    code, _, line = first.partition("\n")
                    self._end(line, int(code))
                if time.monotonic() - heard_at > self.heartbeat_timeout:
                    line = self._lost_line(watched, last)
                    self._reported = EXIT_LOST_PROCESS
                    self._post(watched, EXIT_LOST_PROCESS, line)
                    self._end(line, EXIT_LOST_PROCESS)
            if self._stop.wait(self.poll_s):
                return

    def _lost_line(self, index: int, beat: str) -> str:
        """`beat`: the lost process's last heartbeat ("" if none came)."""
        name = f"process {index} of {jax.process_count()}"
        if not beat:
            return (
                f"{name} sent no heartbeat within distributed.heartbeat_timeout="
                f"{self.heartbeat_timeout:g} s of joining the job: it was stopped, killed or "
                f"cut off from it. {_RESTART}"
            )
        _, who, doing = beat.split("\n", 2)
        return (
            f"{name} ({who}) sent no heartbeat for distributed.heartbeat_timeout="
            f"{self.heartbeat_timeout:g} s while {doing}: it was stopped, killed or cut off "
            f"from the job. {_RESTART}"
        )

    def _watch_coordinator(self) -> None:
        """Process 0 hosts the coordination service: when it stops answering, every call the
        other watcher makes hangs or fails, so the silence is timed here."""
        while not self._stop.wait(self.poll_s):
            if time.monotonic() - self._answered > self.heartbeat_timeout:
                exit_job(
                    f"process 0 of {jax.process_count()} (the coordinator, "
                    f"{self._coordinator}) did not answer for distributed.heartbeat_timeout="
                    f"{self.heartbeat_timeout:g} s while this process was "
                    f"{self.activity()}: it was stopped, killed or cut off from the job. "
                    f"{_RESTART}",
                    EXIT_LOST_PROCESS,
                )


_RESTART = (
    "Ending the job: end that process if it still runs, then start every process again "
    "with the same command; it resumes from the last checkpoint"
)
