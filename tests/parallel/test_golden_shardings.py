"""Golden sharding JSONs: every parameter's PartitionSpec and bytes per device, per mesh preset,
for debugmodel and (abstractly, nothing allocated) the 8B flavour. A diff means the rules table
or the model's logical axes changed: regenerate deliberately with
`TITAN_JAX_UPDATE_GOLDEN=1 pytest tests/parallel/test_golden_shardings.py` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from parallel_helpers import PRESETS, preset_overrides

from titan_jax.config import load_config
from titan_jax.planner import inspect_step
from titan_jax.train.trainer import build_trainer

GOLDEN = Path(__file__).parent / "golden"
FLAVORS = ("debugmodel", "8B")
KEYS = (
    "mesh",
    "mode",
    "params",
    "per_device_param_bytes",
    "total_param_bytes",
    "per_device_state_bytes",
    "total_state_bytes",
)


def sharding_summary(flavor: str, preset: str) -> dict:
    config = load_config(None, ["--model.flavor", flavor, *preset_overrides(preset)])
    report = inspect_step.inspect_trainer(build_trainer(config), compile=False)
    return {"flavor": flavor, "preset": preset, **{k: report[k] for k in KEYS}}


def _dumps(summary: dict) -> str:
    """JSON with one line per parameter, so diffs of the goldens read well."""
    text = json.dumps({**summary, "params": ["PARAMS"]}, indent=1)
    params = ",\n  ".join(json.dumps(p) for p in summary["params"])
    return text.replace('"PARAMS"', params) + "\n"


def _changes(old: dict, new: dict) -> list[str]:
    old_params = {p["name"]: p for p in old["params"]}
    new_params = {p["name"]: p for p in new["params"]}
    lines = [
        f"{name}: {old_params.get(name)} -> {new_params.get(name)}"
        for name in sorted(old_params.keys() | new_params.keys())
        if old_params.get(name) != new_params.get(name)
    ]
    lines += [
        f"{k}: {old.get(k)} -> {new.get(k)}" for k in new if k != "params" and old.get(k) != new[k]
    ]
    return lines


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("preset", PRESETS)
def test_shardings_match_golden(flavor, preset):
    summary = sharding_summary(flavor, preset)
    path = GOLDEN / f"{flavor}_{preset}.json"
    golden = json.loads(path.read_text()) if path.exists() else None
    changes = ["(new file)"] if golden is None else _changes(golden, summary)
    if os.environ.get("TITAN_JAX_UPDATE_GOLDEN") == "1":
        # Regenerating checks nothing: it never passes, so a run that rewrote a golden cannot
        # be mistaken for one that compared against it.
        if changes:
            path.parent.mkdir(exist_ok=True)
            path.write_text(_dumps(summary))
        pytest.skip(
            f"{path.name} rewritten: review the diff"
            if changes
            else f"{path.name} unchanged; run without TITAN_JAX_UPDATE_GOLDEN to check it"
        )
    assert golden is not None, f"{path} missing; run with TITAN_JAX_UPDATE_GOLDEN=1 to create it"
    assert not changes, f"shardings differ from {path.name}:\n" + "\n".join(changes)


def test_golden_8b_fsdp8_shards_every_matrix_eight_ways():
    """A spot check of what the goldens pin: 8B under FSDP 8 holds 1/8 of every matrix."""
    golden = json.loads((GOLDEN / "8B_fsdp8.json").read_text())
    for p in golden["params"]:
        if len(p["shape"]) >= 2 and "norm" not in p["name"]:
            assert "'fsdp'" in p["spec"], p
    assert abs(golden["per_device_param_bytes"] * 8 / golden["total_param_bytes"] - 1) < 1e-3
