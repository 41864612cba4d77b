"""`make plans` rewrites only the rows it compiled (`--only`: a plan by its name, or the plans
under a prefix), keeping the others."""

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
    old = (
        plans.markdown(["| a | 1 | x |", "| b | 2 | y |", "| gone | 0 | u |"])
        + "\n| stale | old | layout | z |"
    )
    rows = plans.merged(old, ["| b | 3 | w |", "| c | 4 | v |"])
    assert rows == ["| a | 1 | x |", "| b | 3 | w |", "| c | 4 | v |"]


def test_a_row_from_before_the_xla_column_is_kept_with_its_estimate_marked_as_the_older_models():
    plans = _plans()
    plans.PLANS = tuple(plans.Plan(name, "configs/qwen3_8b.toml", "v5p-8") for name in "ab")
    new = "| a | " + " | ".join("n" * (i + 1) for i in range(11)) + " |"  # 12 columns
    old = (
        "| b | fsdp4 | full | splash | 1 + 2 | 3 of 4 | yes | 5 s | 1.34 s / 70% (<= 82%) "
        "| 95% | - |"
    )
    rows = plans.merged(plans.markdown([new]) + "\n" + old, [new])
    assert rows[1].split("|")[9:11] == [f" 1.34 s / 70% (<= 82%) {plans.STALE} ", " - "]
    assert rows[1].count("|") == new.count("|")


def test_only_takes_a_plan_by_its_exact_name_before_a_prefix_of_names():
    plans = _plans()
    plans.PLANS = tuple(
        plans.Plan(name, "configs/qwen3_8b.toml", "v5p-8") for name in ("x 16", "x 16 wide", "y")
    )
    names = [p.name for p in plans.PLANS]
    assert [n for n in names if plans.selects("x 16", n)] == ["x 16"]
    assert [n for n in names if plans.selects("x 1", n)] == ["x 16", "x 16 wide"]
