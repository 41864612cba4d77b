"""`make plans` rewrites only the rows it compiled (`--only`), keeping the others."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plans():
    spec = importlib.util.spec_from_file_location("tpu_plans", ROOT / "benchmarks/tpu_plans.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tpu_plans"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_only_replaces_its_rows_and_drops_an_older_layout_and_removed_plans():
    plans = _plans()
    plans.PLANS = tuple(plans.Plan(name, "configs/qwen3_8b.toml", "v5p-8") for name in "abc")
    old = (plans.markdown(["| a | 1 | x |", "| b | 2 | y |", "| gone | 0 | u |"])
           + "\n| stale | old | layout | z |")
    rows = plans.merged(old, ["| b | 3 | w |", "| c | 4 | v |"])
    assert rows == ["| a | 1 | x |", "| b | 3 | w |", "| c | 4 | v |"]
