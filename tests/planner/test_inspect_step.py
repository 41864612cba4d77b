"""`titan-jax inspect` (titan_jax/planner/inspect_step.py): the HLO collective parser and the
report."""

from __future__ import annotations

import json

import jax
import numpy as np
from tiny_model import TINY

from titan_jax.cli import main
from titan_jax.config import load_config
from titan_jax.planner.inspect_step import abstract_batch, collective_counts
from titan_jax.train.setup import build_data
from titan_jax.train.trainer import build_trainer

HLO = """
ENTRY %main {
  %all-gather = bf16[64,32]{1,0} all-gather(%p), channel_id=1, dimensions={0}
  %all-gather.1 = bf16[64,32]{1,0} all-gather(%q), channel_id=2, dimensions={0}
  %all-reduce = (f32[32,64]{1,0}, f32[8]{0}) all-reduce(%a, %b), to_apply=%add
  ROOT %reduce-scatter.3 = f32[8,64]{1,0} reduce-scatter(%c), dimensions={0}
  %ag-start = (bf16[8,32]{1,0:T(8,128)}, bf16[64,32]{1,0:T(8,128)}) all-gather-start(%r)
  %ag-done = bf16[64,32]{1,0} all-gather-done(%ag-start)
  %all-reduce-start = f32[16]{0} all-reduce-start(%d), to_apply=%add
  %all-reduce-done = f32[16]{0} all-reduce-done(%all-reduce-start)
  %cp = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%e), pairs={{0,1}}
  %fusion = f32[4]{0} fusion(%all-reduce), kind=kLoop, calls=%fused_all-reduce
}
"""


def test_collectives_parser_groups_by_op_and_dtype():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    assert collective_counts(HLO, mesh) == [
        {"op": "all-gather", "dtype": "bf16", "count": 3, "bytes": 3 * 64 * 32 * 2},
        {"op": "all-reduce", "dtype": "f32", "count": 2, "bytes": (32 * 64 + 8 + 16) * 4},
        {"op": "collective-permute", "dtype": "f32", "count": 1, "bytes": 16},
        {"op": "reduce-scatter", "dtype": "f32", "count": 1, "bytes": 8 * 64 * 4},
    ]


def test_cli_inspect_prints_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = main(
        [
            "inspect",
            "--config",
            "configs/qwen3_debug.toml",
            "--parallelism.data_parallel_shard_degree",
            "8",
            "--training.local_batch_size",
            "1",
            "--training.seq_len",
            "16",
            "--training.mixed_precision_param",
            "bfloat16",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    for key in ("params", "per_device_param_bytes", "total_param_bytes", "collectives", "memory"):
        assert key in report
    wq = next(p for p in report["params"] if p["name"] == "layers.attention.wq")
    assert wq == {
        "name": "layers.attention.wq",
        "shape": [8, 256, 16, 128],
        "dtype": "float32",
        "spec": "(None, 'fsdp')",
        "bytes_per_device": 8 * 256 * 16 * 128 * 4 // 8,
    }
    # 1/8 of everything but the replicated per-head q/k norm weights.
    assert abs(report["per_device_param_bytes"] * 8 / report["total_param_bytes"] - 1) < 0.01
    assert {c["op"] for c in report["collectives"]} >= {"all-gather", "all-reduce"}
    assert all(set(c) == {"op", "dtype", "count", "bytes"} for c in report["collectives"])
    assert report["memory"]["temp_size_in_bytes"] > 0
    printed = capsys.readouterr().out
    assert "layers.attention.wq" in printed and "(None, 'fsdp')" in printed
    assert "collectives after SPMD partitioning" in printed and "bf16" in printed


def test_cli_inspect_bad_mesh_is_one_line_error(capsys):
    rc = main(
        [
            "inspect",
            "--config",
            "configs/qwen3_debug.toml",
            "--parallelism.data_parallel_shard_degree",
            "3",
        ]
    )
    assert rc == 2
    assert "but there are 8 devices" in capsys.readouterr().err


def test_inspect_and_compile_lower_the_program_training_runs(tmp_path):
    """With document masking the stream feeds (B, T, 3) inputs (ids, segment ids, positions):
    the abstract batch that inspect and compile lower is that batch, so they lower the step
    training compiles."""
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"doc {i} " + "word " * (i % 5)}) + "\n" for i in range(40))
    )
    config = load_config(
        None,
        [
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            str(corpus),
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--training.document_mask",
            "true",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
    )
    trainer = build_trainer(config, jax.devices()[:2], model_args=TINY)
    fed = trainer.batches.put(next(build_data(trainer)))
    lowered = abstract_batch(trainer)
    assert lowered["inputs"].shape == (4, 16, 3)
    assert {k: (v.shape, v.dtype, v.sharding) for k, v in lowered.items()} == {
        k: (v.shape, v.dtype, v.sharding) for k, v in fed.items()
    }
    state = trainer.abstract_state()
    assert trainer.lower_step(state, lowered).as_text() == trainer.lower_step(state, fed).as_text()
