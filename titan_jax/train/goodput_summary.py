"""A run's goodput across restarts, read from its goodput.jsonl (`train/goodput.py` writes it).

Each process (a "lifetime") recorded its own seconds. Reading them in order decides what the
records alone cannot: a process that resumes from the checkpoint of step s repeats every step
after s that earlier processes trained, so their time moves from productive to recomputed
(split by steps where a record straddles s); and the gap from one process's last record to the
next one's start is a pause. Goodput = productive / total wall time, where the total runs from
the first process's start to the last record.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

from titan_jax.data.paths import filesystem, join
from titan_jax.errors import TitanJaxError
from titan_jax.train.goodput import CATEGORIES, RECORD_FILE, STEP


class GoodputRecordsError(TitanJaxError, ValueError):
    """A folder with no goodput records to summarise."""


@dataclasses.dataclass
class Lifetime:
    """One process of the run, as its records tell it."""

    number: int
    process_start: float  # Unix seconds
    last_record: float
    start_step: int | None  # the step it started after (None: its start record is lost)
    seconds: dict[str, float]
    steps: tuple[int, int] | None = None  # the first and last step it trained
    recomputed_steps: int = 0
    ended: str = "killed"  # or the end record's reason

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "process": self.number,
            "process_start": self.process_start,
            "last_record": self.last_record,
            "start_step": self.start_step,
            "steps": list(self.steps) if self.steps else None,
            "recomputed_steps": self.recomputed_steps,
            "ended": self.ended,
            "total_s": self.total_s,
            "goodput": _share(self.seconds, self.total_s),
            "seconds": self.seconds,
        }


@dataclasses.dataclass
class Summary:
    run_folder: str
    lifetimes: list[Lifetime]

    @property
    def seconds(self) -> dict[str, float]:
        return {k: sum(life.seconds.get(k, 0.0) for life in self.lifetimes) for k in CATEGORIES}

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        return _share(self.seconds, self.total_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_folder": self.run_folder,
            "total_s": self.total_s,
            "goodput": self.goodput,
            "seconds": self.seconds,
            "lifetimes": [life.to_json() for life in self.lifetimes],
        }

    def table(self) -> str:
        seconds, total = self.seconds, self.total_s
        n = len(self.lifetimes)
        lines = [
            f"goodput of {self.run_folder}: {100 * self.goodput:.1f}% (productive "
            f"{seconds['productive']:.1f} s of {total:.1f} s wall time, {n} process"
            f"{'es' if n > 1 else ''})",
            "",
            f"{'category':<20}{'seconds':>10}{'share':>8}  ml-goodput-measurement",
        ]
        for key, (_, theirs) in CATEGORIES.items():
            share = seconds[key] / total if total else 0.0
            lines.append(f"{key:<20}{seconds[key]:>10.1f}{100 * share:>7.1f}%  {theirs}")
        lines += [
            f"{'total':<20}{total:>10.1f}{100.0 if total else 0.0:>7.1f}%",
            "",
            f"{'process':<8}{'started (UTC)':<21}{'steps':<13}{'pause s':>8}"
            f"{'wall s':>9}{'productive s':>13}{'recomputed':>16}{'goodput':>9}  ended",
        ]
        for life in self.lifetimes:
            started = datetime.datetime.fromtimestamp(life.process_start, datetime.UTC)
            steps = f"{life.steps[0]}-{life.steps[1]}" if life.steps else "-"
            redone = (
                f"{life.recomputed_steps} ({life.seconds.get('recomputed', 0.0):.1f} s)"
                if life.recomputed_steps
                else "-"
            )
            lines.append(
                f"{life.number:<8}{started:%Y-%m-%d %H:%M:%S}  {steps:<13}"
                f"{life.seconds.get('pause', 0.0):>8.1f}{life.total_s:>9.1f}"
                f"{life.seconds.get('productive', 0.0):>13.1f}{redone:>16}"
                f"{100 * _share(life.seconds, life.total_s):>8.1f}%  {life.ended}"
            )
        return "\n".join(lines)


def _share(seconds: dict[str, float], total: float) -> float:
    return seconds.get("productive", 0.0) / total if total else 0.0


def read_records(run_folder: str) -> list[dict[str, Any]]:
    """The records of `run_folder`/goodput.jsonl (a local folder or a URL), torn lines left
    out; raises GoodputRecordsError when there are none."""
    fs, root = filesystem(run_folder)
    where = join(run_folder, RECORD_FILE)
    if not fs.isdir(root):
        raise GoodputRecordsError(
            f"{run_folder} is not a folder; give the job.dump_folder of a run of titan-jax train"
        )
    try:
        text = fs.cat_file(join(root, RECORD_FILE)).decode(errors="replace")
    except FileNotFoundError:
        raise GoodputRecordsError(
            f"{run_folder} holds no {RECORD_FILE}: it is not the job.dump_folder of a run of "
            "titan-jax train, or the run started before goodput was recorded"
        ) from None
    except IsADirectoryError:
        raise GoodputRecordsError(f"{where} is a folder, not a file of goodput records") from None
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
            if (
                isinstance(record, dict)
                and isinstance(record.get("lifetime"), int)
                and isinstance(record.get("time"), (int, float))
            ):
                records.append(record)
        except ValueError:  # torn by a kill
            continue
    if not records:
        raise GoodputRecordsError(
            f"{where} holds no goodput records (none was written before "
            "the run stopped, or the file is not titan-jax's)"
        )
    return records


@dataclasses.dataclass
class _Trained:
    """Step time of one record: steps `first`..`last` (those still counted as kept)."""

    lifetime: Lifetime
    first: int
    last: int
    per_step_s: float


def summarize(run_folder: str, records: list[dict[str, Any]]) -> Summary:
    """Per-process and whole-run seconds of every category (see the module docstring)."""
    lifetimes: dict[int, Lifetime] = {}
    trained: list[_Trained] = []
    for record in records:
        number = record["lifetime"]
        life = lifetimes.get(number)
        if life is None:
            life = lifetimes[number] = _open_lifetime(record, list(lifetimes.values()), trained)
        life.last_record = max(life.last_record, float(record["time"]))
        seconds = {
            k.removesuffix("_s"): float(v)
            for k, v in record.items()
            if k.endswith("_s") and isinstance(v, (int, float))
        }
        step_s = seconds.pop(STEP, 0.0)
        for key, value in seconds.items():
            key = key if key in CATEGORIES else "other"
            life.seconds[key] = life.seconds.get(key, 0.0) + value
        life.seconds["productive"] = life.seconds.get("productive", 0.0) + step_s
        if steps := _steps(record):
            life.steps = (life.steps or steps)[0], steps[1]
            trained.append(_Trained(life, *steps, step_s / (steps[1] - steps[0] + 1)))
        if record.get("event") == "end":
            life.ended = str(record.get("reason", "finished"))
    return Summary(run_folder, list(lifetimes.values()))


def _open_lifetime(
    record: dict[str, Any], earlier: list[Lifetime], trained: list[_Trained]
) -> Lifetime:
    """A process's first record: the pause since the one before, and the steps it repeats."""
    started = record.get("process_start")
    started = float(started if isinstance(started, (int, float)) else record["time"])
    start_step = record.get("step") if record.get("event") == "start" else None
    life = Lifetime(
        record["lifetime"],
        started,
        started,
        start_step if isinstance(start_step, int) else None,
        {},
    )
    if earlier:
        life.seconds["pause"] = max(0.0, started - earlier[-1].last_record)
    if life.start_step is not None:
        for block in trained:  # earlier steps past the resume point are trained again
            repeated = block.last - max(block.first, life.start_step + 1) + 1
            if repeated <= 0:
                continue
            moved = repeated * block.per_step_s
            block.lifetime.seconds["productive"] -= moved
            block.lifetime.seconds["recomputed"] = (
                block.lifetime.seconds.get("recomputed", 0.0) + moved
            )
            block.lifetime.recomputed_steps += repeated
            block.last -= repeated
    return life


def _steps(record: dict[str, Any]) -> tuple[int, int] | None:
    steps = record.get("steps")
    if (
        isinstance(steps, list)
        and len(steps) == 2
        and all(isinstance(s, int) for s in steps)
        and steps[0] <= steps[1]
    ):
        return steps[0], steps[1]
    return None
