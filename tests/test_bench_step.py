"""Tests for benchmarks/bench_step.py's output: the table and where it is written."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "benchmarks/bench_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_step", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_table_is_formatted_and_written_only_between_markers(tmp_path):
    bench = load_bench()
    result = bench.Result("tiny", 1.234, 1024, 0.5, None, 2e9)
    table = bench.markdown([result], 1e11, "measured", 4, 256, "none")
    assert "| tiny | 1.2M | 0.500 | 2,048 | 4.0% | n/a | n/a | n/a |" in table
    doc = tmp_path / "B.md"
    doc.write_text(f"intro\n{bench.BEGIN}\nold\n{bench.END}\nnotes\n")
    bench.write_table(doc, table)
    assert doc.read_text() == f"intro\n{bench.BEGIN}\n{table}\n{bench.END}\nnotes\n"


def test_make_bench_does_not_rewrite_benchmarks_md():
    makefile = (ROOT / "Makefile").read_text()
    bench = makefile.split("\nbench:\n", 1)[1].split("\n\n", 1)[0]
    assert "--write" not in bench
    assert "--write BENCHMARKS.md" in makefile.split("\nbench-update:\n", 1)[1].split("\n\n")[0]


def test_the_pytorch_side_builds_moe_models_too():
    """The MoE row times HF's Qwen3MoeForCausalLM (picked from the config's model_type)."""
    import pytest

    pytest.importorskip("transformers")
    from titan_jax.models.qwen3 import Qwen3Args

    bench = load_bench()
    args = Qwen3Args(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, vocab_size=64,
                     tie_embeddings=False, num_experts=4, top_k=2, moe_inter_dim=16)
    assert bench.time_torch(args, 1, 8, 0, 1) > 0
