"""Tests for benchmarks/bench_gpu.py (the measurement behind benchmarks/gpu.sh) on CPU: the
smoke path end to end, on the packages the lent GPU machine has, the attention fallback and the
OOM retry."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from titan_jax.config import ConfigError

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
# Packages titan-jax's install has and the lent GPU machine's image does not (the device tool's
# KINDS.md; nothing can be installed there): gpu.sh's training steps must not need them.
NOT_ON_THE_GPU_MACHINE = ("qwix", "tokamax", "datasets", "tensorboardX", "gcsfs", "libtpu")


def without_packages(tmp_path: Path, names: tuple[str, ...]) -> str:
    """A PYTHONPATH whose sitecustomize makes importing any of `names` fail, as where they are
    not installed; child processes inherit it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {names!r}:\n"
        "    sys.modules[name] = None  # `import name` raises ModuleNotFoundError\n"
    )
    return f"{site}:{ROOT}"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks/bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_gpu", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_run_measures_a_step_and_writes_json_and_markdown(bench, tmp_path, monkeypatch):
    # the row runs in a child process (run_isolated), here without what the GPU machine lacks
    monkeypatch.setenv("PYTHONPATH", without_packages(tmp_path, NOT_ON_THE_GPU_MACHINE))
    rows = bench.main(["--smoke", "--out", str(tmp_path / "out")])
    assert len(rows) == 1 and "error" not in rows[0], rows
    row = rows[0]
    assert (row["model"], row["batch"], row["seq_len"], row["tokens_per_step"]) == (
        "smoke",
        2,
        32,
        64,
    )
    assert row["dtype"] == "float32"  # mixed_precision_param=auto on CPU; bf16 on a GPU
    assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(64 / row["step_s"])
    assert 0 < row["mfu_pct"] < 100 and row["peak_memory_gib"] > 0
    assert row["compiled_args_plus_temps_gib"] > 0
    assert row["attention"] == "default"
    (json_file,) = (tmp_path / "out").glob("gpu_bench-*.json")
    assert json.loads(json_file.read_text()) == rows
    assert "| smoke | 2 x 32 | default |" in json_file.with_suffix(".md").read_text()


def test_cudnn_attention_is_asked_for_only_when_the_config_accepts_it(bench, monkeypatch):
    asked = []

    def accepts(path, overrides):
        asked.append(overrides)

    monkeypatch.setattr(bench, "load_config", accepts)
    assert bench.attention_overrides("cudnn") == (["--model.attention", "cudnn"], "cudnn")
    assert asked == [["--model.attention", "cudnn"]]

    def rejects(path, overrides):
        raise ConfigError("unknown config key model.attention")

    monkeypatch.setattr(bench, "load_config", rejects)
    assert bench.attention_overrides("cudnn") == (
        [],
        "default (config rejects model.attention=cudnn)",
    )
    assert bench.attention_overrides("default") == ([], "default")


def test_an_out_of_memory_row_is_retried_at_half_the_batch(bench, monkeypatch):
    tried = []

    def run_isolated(plan, model, batch, overrides, timeout_s):
        tried.append((model, batch))
        if batch > 2:
            return {"model": model, "batch": batch, "error": "exit 1: RESOURCE_EXHAUSTED: oom"}
        return {"model": model, "batch": batch, "error": "exit 1: some other failure"}

    monkeypatch.setattr(bench, "run_isolated", run_isolated)
    monkeypatch.setattr(bench, "attention_overrides", lambda requested: ([], "default"))
    written = []
    plan = bench.Plan(["0.6B", "1.7B"], 8, 4096, 1, 1, "selective", "default", 600)
    rows = bench.run_plan(plan, lambda rows: written.append(len(rows)))
    # OOM halves the batch; any other failure ends that model's attempts.
    assert tried == [("0.6B", 8), ("0.6B", 4), ("0.6B", 2), ("1.7B", 8), ("1.7B", 4), ("1.7B", 2)]
    assert [r["batch"] for r in rows] == [8, 4, 2, 8, 4, 2] and written == [1, 2, 3, 4, 5, 6]
    table = bench.markdown(rows)
    assert "| 0.6B | 8 | default | failed: exit 1: RESOURCE_EXHAUSTED: oom |" in table


def test_versions_name_every_package_and_the_devices(bench, capsys):
    import jax

    found = bench.versions()
    assert found["jax"] == jax.__version__ and found["devices"].startswith("cpu:")
    assert set(bench.PACKAGES) <= set(found)
    with pytest.raises(SystemExit):  # no GPU here: gpu.sh stops before the timed rows
        bench.main(["--versions"])
    assert f"jax: {jax.__version__}" in capsys.readouterr().out
