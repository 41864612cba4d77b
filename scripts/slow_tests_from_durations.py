"""Writes tests/slow_by_measurement.txt from a full run's `--durations=0` output: every test
not already marked slow whose call, setup and teardown took `--budget` seconds or more. The
suite's conftest marks them slow, so that `make test-fast` stays the quick loop (under 8 min);
`make test` still runs them.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 tests > run.log
    .venv/bin/python scripts/slow_tests_from_durations.py run.log
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "slow_by_measurement.txt"
IGNORE_LIST = "TITAN_JAX_IGNORE_SLOW_LIST"  # tests/conftest.py: collect as if no list
DURATION = re.compile(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+(\S.*?)\s*$")


def durations(log: Path) -> dict[str, float]:
    """Seconds per test id (call, setup and teardown summed) from pytest's --durations lines."""
    seconds: collections.Counter[str] = collections.Counter()
    for line in log.read_text().splitlines():
        if m := DURATION.match(line):
            seconds[m[2]] += float(m[1])
    return dict(seconds)


def marked_fast() -> set[str]:
    """The ids `-m "not slow"` collects today, before this list's marks (they are what the
    list may add to)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "tests"],
        cwd=ROOT,
        env={**os.environ, IGNORE_LIST: "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--budget", type=float, default=8.0, help="seconds (default 8)")
    args = parser.parse_args()
    fast, seconds = marked_fast(), durations(args.log)
    slow = sorted((s, t) for t, s in seconds.items() if t in fast and s >= args.budget)
    header = (
        f"# Tests that took >= {args.budget:g} s in a full run (call + setup + teardown), marked\n"
        "# slow by tests/conftest.py; written by scripts/slow_tests_from_durations.py.\n"
    )
    LIST.write_text(header + "".join(f"{s:7.1f}  {t}\n" for s, t in reversed(slow)))
    print(f"{len(slow)} tests, {sum(s for s, _ in slow):.0f} s, written to {LIST}")


if __name__ == "__main__":
    main()
