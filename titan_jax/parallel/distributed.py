"""Multi-process runs: `jax.distributed.initialize` from `[distributed]`, and a job-wide failure
channel so that one process's error ends every process of the job with that error's message.

Both sides of a failure are handled here because JAX alone handles neither well: a coordinator
that never answers, or a process that never arrives, aborts the waiting processes from C++
("Terminating process because the JAX distributed service detected fatal errors") with no
word of the setting to fix; and a process that dies mid-run leaves the others blocked in a
collective until a transport timeout, with a message about the transport, not the cause.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import TracebackType

import jax

from titan_jax.config import AUTO, Distributed
from titan_jax.errors import TitanJaxError
from titan_jax.jax_platform import is_tpu_host

# JAX's own connect deadline is ours plus this, so ours fires first with a message to act on.
_GRACE_S = 10
_FAILED_KEY = "titan_jax/failed/"  # + process index -> "exit code\nmessage"


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
                    f"{d.initialization_timeout} s (is process 0 running there?)") from None
            time.sleep(0.2)


def initialize_distributed(d: Distributed) -> bool:
    """Joins the job described by `d` (call before JAX's backend starts); returns whether this
    is a multi-process run. Raises DistributedError, or exits (code 2) with one line naming
    `distributed.*`, when the processes do not all meet within the timeout."""
    if jax.distributed.is_initialized():
        return True
    if d.num_processes == 1 or (d.num_processes == AUTO and (
            not is_tpu_host() or _tpu_env_names_one_host())):
        return False
    deadline = time.monotonic() + d.initialization_timeout
    if d.num_processes == AUTO:  # a TPU cluster: JAX reads the hosts from its environment
        kwargs: dict = {}
        who, hint = "this process", "start the same command on every host of the slice"
    else:
        kwargs = {"coordinator_address": d.coordinator_address,
                  "num_processes": d.num_processes, "process_id": d.process_id}
        who = f"process {d.process_id} of {d.num_processes}"
        hint = ("start the same command on every host, each with its own "
                "distributed.process_id")
        if d.process_id != 0:
            _wait_for_coordinator(d, deadline)
    message = (f"{who}: not every process reached distributed.coordinator_address="
               f"{d.coordinator_address or '(auto-detected)'} within "
               f"distributed.initialization_timeout={d.initialization_timeout} s; {hint}")
    remaining = max(deadline - time.monotonic(), 1.0)
    watchdog = threading.Timer(remaining, exit_job, (str(DistributedError(message)), 2))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs,
                                   initialization_timeout=int(remaining) + _GRACE_S)
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


class JobFailures:
    """With several processes: a failure of this process is posted to JAX's coordination
    service (`report`, or an exception leaving a `guard()`), and a watcher thread ends this
    process with the first failure another process posted. One process: does nothing."""

    def __init__(self, poll_s: float = 0.5):
        self.poll_s = poll_s
        self._client = None
        self._stop = threading.Event()
        self._reported: int | None = None  # the exit code of this process's own failure
        self._thread: threading.Thread | None = None

    def __enter__(self) -> JobFailures:
        if jax.process_count() > 1:
            from jax._src.distributed import global_state  # the client JAX connected with

            self._client = global_state.client
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="titan-jax-job-failures")
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if error is not None:
            self.report(error)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
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
        code, message = _exit_code_and_message(error)
        self._reported = code
        with contextlib.suppress(Exception):  # the service may be gone: JAX then ends the job
            self._client.key_value_set(f"{_FAILED_KEY}{jax.process_index()}",
                                       f"{code}\n{message}")

    def _watch(self) -> None:
        me, count = jax.process_index(), jax.process_count()
        while not self._stop.wait(self.poll_s):
            try:
                posted = self._client.key_value_dir_get(_FAILED_KEY)
            except Exception:  # the service is gone: JAX's heartbeat ends the job
                return
            failed = sorted((int(key.rsplit("/", 1)[-1]), value) for key, value in posted)
            failed = [(i, value) for i, value in failed if i != me]
            if failed and self._reported is None:
                index, value = failed[0]
                code, _, message = value.partition("\n")
                if me == 0:  # the service lives here: let the others read the failure first
                    time.sleep(4 * self.poll_s)
                exit_job(f"process {index} of {count} failed: {message}", int(code))
