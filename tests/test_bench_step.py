"""Tests for benchmarks/bench_step.py: the table, where it is written, and the MaxText column's
command and log parsing (maxtext_bench.py; no MaxText install needed)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from titan_jax.models.qwen3 import Qwen3Args

ROOT = Path(__file__).resolve().parents[1]
# bench_step.py imports its sibling maxtext_bench as a script would (benchmarks/ on the path).
sys.path.insert(0, str(ROOT / "benchmarks"))


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "benchmarks/bench_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_step", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_table_is_formatted_and_written_only_between_markers(tmp_path):
    bench = load_bench()
    result = bench.Result("tiny", 1.234, 4, 1024, 0.5, 1.0, None, 2e9)
    table = bench.markdown([result], 1e11, "measured", 256, "none", ["no MaxText."])
    assert (
        "| tiny | 4 x 256 | 1.2M | 0.500 | 2,048 | 4.0% | 1.000 | 1,024 | 2.0% | "
        "n/a | n/a | n/a | 2.00x | n/a |"
    ) in table
    assert "\nno MaxText.\n" in table
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
    pytest.importorskip("transformers")
    bench = load_bench()
    args = Qwen3Args(
        dim=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        vocab_size=64,
        tie_embeddings=False,
        num_experts=4,
        top_k=2,
        moe_inter_dim=16,
    )
    assert bench.time_torch(args, 1, 8, 0, 1) > 0


def test_maxtext_command_carries_the_shape_and_recipe():
    import maxtext_bench

    args = Qwen3Args(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        head_dim=64,
        hidden_dim=3072,
        vocab_size=2048,
        tie_embeddings=False,
        rope_theta=5e5,
    )
    cmd = maxtext_bench.maxtext_command(
        Path("/v/bin/python"), Path("/m/configs/base.yml"), args, 8, 256, 7, Path("/tmp/out")
    )
    assert cmd[:4] == [
        "/v/bin/python",
        "-m",
        "maxtext.trainers.pre_train.train",
        "/m/configs/base.yml",
    ]
    keys = dict(arg.split("=", 1) for arg in cmd[4:])
    assert len(keys) == len(cmd) - 4  # each key once
    assert {
        k: keys[k]
        for k in (
            "base_emb_dim",
            "base_num_decoder_layers",
            "base_num_query_heads",
            "base_num_kv_heads",
            "head_dim",
            "base_mlp_dim",
            "vocab_size",
            "logits_via_embedding",
            "rope_max_timescale",
        )
    } == {
        "base_emb_dim": "768",
        "base_num_decoder_layers": "12",
        "base_num_query_heads": "12",
        "base_num_kv_heads": "4",
        "head_dim": "64",
        "base_mlp_dim": "3072",
        "vocab_size": "2048",
        "logits_via_embedding": "false",
        "rope_max_timescale": "500000",
    }
    assert {
        k: keys[k]
        for k in (
            "per_device_batch_size",
            "max_target_length",
            "steps",
            "weight_dtype",
            "dtype",
            "hardware",
            "base_output_directory",
            "override_model_config",
            "enable_checkpointing",
        )
    } == {
        "per_device_batch_size": "8",
        "max_target_length": "256",
        "steps": "7",
        "weight_dtype": "float32",
        "dtype": "float32",
        "hardware": "cpu",
        "base_output_directory": "/tmp/out",
        "override_model_config": "true",
        "enable_checkpointing": "false",
    }
    with pytest.raises(ValueError, match="dense"):
        maxtext_bench.maxtext_command(
            Path("p"),
            Path("b"),
            Qwen3Args(num_experts=4, top_k=2, moe_inter_dim=16),
            1,
            8,
            1,
            Path("o"),
        )


# Lines as MaxText 0.2.4 prints them (absl prefix, then metric_logger's fields).
MAXTEXT_LOG = """\
I1201 03:08:10.1 1 train.py:400] Compiling the train step
I1201 03:08:20.4 1 metric_logger.py:230] completed step: 0, seconds: 1.055, TFLOP/s/device: 0.211, Tokens/s/device: 970.767, total_weights: 1024, loss: 116.119
I1201 03:08:25.0 1 metric_logger.py:230] completed step: 1, seconds: 0.329, TFLOP/s/device: 0.675, Tokens/s/device: 3108.069, total_weights: 1024, loss: 105.622
I1201 03:08:29.5 1 metric_logger.py:230] completed step: 2, seconds: 6.348, TFLOP/s/device: 0.035, Tokens/s/device: 161.315, total_weights: 1024, loss: 97.538
I1201 03:08:34.0 1 metric_logger.py:230] completed step: 3, seconds: 4.591, TFLOP/s/device: 0.048, Tokens/s/device: 223.061, total_weights: 1024, loss: 94.242
I1201 03:08:38.4 1 metric_logger.py:230] completed step: 4, seconds: 4.402, TFLOP/s/device: 0.050, Tokens/s/device: 232.611, total_weights: 1024, loss: 90.001
"""  # noqa: E501


def test_maxtext_step_times_are_parsed_and_the_warm_up_dropped():
    import maxtext_bench

    times = maxtext_bench.parse_step_times(MAXTEXT_LOG)
    assert times == {0: 1.055, 1: 0.329, 2: 6.348, 3: 4.591, 4: 4.402}
    assert maxtext_bench.median_after_warmup(times, 2, 3) == 4.591
    with pytest.raises(ValueError, match="logged 3 steps after 2 warm-up steps, expected 5"):
        maxtext_bench.median_after_warmup(times, 2, 5)


def test_bench_runs_without_the_maxtext_venv(tmp_path):
    import maxtext_bench

    assert maxtext_bench.maxtext_python(tmp_path / "absent") is None
    assert "make bench-deps" in maxtext_bench.HOW_TO_ADD


def test_maxtext_aot_reads_the_compiled_programs_memory():
    import maxtext_aot

    log = (
        "Jitting and compilation complete!\nMemory analysis: CompiledMemoryStats("
        "generated_code_size_in_bytes=1, argument_size_in_bytes=24575561728, "
        "output_size_in_bytes=24575561728, alias_size_in_bytes=24575561728, "
        "temp_size_in_bytes=20108549312, host_generated_code_size_in_bytes=0)\n"
    )
    assert maxtext_aot.memory_of(log) == {
        "argument_size_in_bytes": 24575561728,
        "temp_size_in_bytes": 20108549312,
    }
    with pytest.raises(RuntimeError, match="no memory analysis"):
        maxtext_aot.memory_of("Traceback ...")
    assert set(maxtext_aot.RECIPES) >= {"8B v5p-8", "8B v6e-8", "235B-A22B v5p-256"}
