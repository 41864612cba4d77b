"""The run's log file, `{job.dump_folder}/titan-jax.log`: where library chatter and tracebacks go.

orbax and absl log hundreds of lines (tracebacks included) when a save fails; on the terminal
they bury the one line that says what happened. While a run is going, their records go to the
log file only, and an error that ends the run is written there with its whole chain of causes,
so the terminal shows one line that points at the file. The file is created at the first record:
a run that logs nothing leaves none.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from types import TracebackType

import jax

from titan_jax.errors import TitanJaxError

LOG_FILE = "titan-jax.log"
# Loggers whose records go to the file only (they are libraries' internals, not the user's).
QUIET = ("absl", "orbax")


class _NotQuiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] not in QUIET


class RunLog:
    """Context manager: root logger records (WARNING and up) also to the file, QUIET loggers'
    only to the file; an exception that ends the run is logged there with its causes."""

    def __init__(self, folder: str | Path):
        index = jax.process_index()
        self.path = Path(folder) / (LOG_FILE if index == 0 else f"titan-jax.{index}.log")
        self._handler = logging.FileHandler(self.path, delay=True)
        self._handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        self._filter = _NotQuiet()
        self._filtered: list[logging.Handler] = []

    def __enter__(self) -> RunLog:
        root = logging.getLogger()
        self._filtered = list(root.handlers)
        for handler in self._filtered:
            handler.addFilter(self._filter)
        root.addHandler(self._handler)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if (
            error is not None
            and not isinstance(error, KeyboardInterrupt)
            and (not isinstance(error, TitanJaxError) or error.__cause__ is not None)
        ):
            # Bad input needs only its one line; a wrapped failure gets its causes on record.
            text = "".join(traceback.format_exception(kind, error, tb))
            self._handler.handle(
                logging.makeLogRecord(
                    {
                        "name": "titan_jax",
                        "levelno": logging.ERROR,
                        "levelname": "ERROR",
                        "msg": f"the run stopped:\n{text}",
                    }
                )
            )
            if isinstance(error, TitanJaxError):
                error.args = (f"{error} (details in {self.path})", *error.args[1:])
        root = logging.getLogger()
        root.removeHandler(self._handler)
        self._handler.close()
        for handler in self._filtered:
            handler.removeFilter(self._filter)
