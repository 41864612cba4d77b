"""`titan-jax compile` (planner/aot_compile.py): the train step compiled for named TPU slices on
this CPU with libtpu, and its report."""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path

import pytest

from titan_jax.cli import main
from titan_jax.planner import calibration, hlo_stats, topology

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)",
)


def test_unknown_topology_lists_the_valid_names(capsys):
    rc = main(["compile", "--config", "configs/qwen3_debug.toml", "--topology", "v5p-6"])
    err = capsys.readouterr().err
    assert rc == 2 and "--topology 'v5p-6'" in err and "v5p-8" in err and "v6e-256" in err
    assert len(err.strip().splitlines()) == 1


def test_missing_libtpu_says_how_to_install_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
    )
    rc = main(["compile", "--config", "configs/qwen3_debug.toml", "--topology", "v5e-4"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install -e '.[tpu]'" in err
    # The hint works: the `tpu` extra exists and brings libtpu with the pinned jax.
    extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("jax[tpu]==") for req in extras["tpu"])


@needs_libtpu
def test_degrees_must_match_the_chips(capsys):
    rc = main(
        [
            "compile",
            "--config",
            "configs/qwen3_debug.toml",
            "--topology",
            "v5p-8",
            "--parallelism.data_parallel_shard_degree",
            "8",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--topology v5p-8 x 1 slice(s) = 4 devices" in err
    assert "but there are 4 devices" in err


def _compile(tmp_path: Path, topology_name: str, *extra: str) -> dict:
    out = tmp_path / "report.json"
    assert (
        main(
            [
                "compile",
                "--config",
                "configs/qwen3_debug.toml",
                "--topology",
                topology_name,
                "--training.seq_len",
                "256",
                "--training.local_batch_size",
                "2",
                "--json",
                str(out),
                *extra,
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


# On the v5p-8, cp2 with 1024-token sequences, one per rank pair: each rank's splash calls
# run one query chunk against the whole keys, and are counted at their share of the causal
# blocks (kernel_flops.py).
CP2 = (
    "--parallelism.context_parallel_degree",
    "2",
    "--training.seq_len",
    "1024",
    "--training.local_batch_size",
    "1",
    "--validation.enable",
    "false",
)


# Two v5p-8 slices with HSDP: the replicate axis spans them, so only the gradient all-reduce
# crosses the data-centre network.
HSDP_OVER_DCN = ("--num-slices", "2", "--parallelism.data_parallel_replicate_degree", "2")


@pytest.mark.usefixtures("least_compile_effort")
@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("extra", [HSDP_OVER_DCN, CP2], ids=["2xv5p-8-hsdp", "v5p-8-cp2"])
def test_debug_model_fits_and_counts_its_flops(tmp_path, extra, capsys):
    report = _compile(tmp_path, "v5p-8", *extra)
    cp = extra == CP2
    for key in (
        "fits",
        "per_chip_bytes",
        "hbm_bytes",
        "flops_per_step",
        "analytic_flops_per_step",
        "collectives",
        "compile_s",
        "est_step_time_s",
        "est_mfu_pct",
        "roofline_mfu_pct",
        "top_buffers",
        "scheduler_flags",
        "in_loop_all_gather_overlap_pct",
        "est_step_time_band_s",
        "est_mfu_band_pct",
        "cost_analysis_bytes_per_chip",
        "est_flops_loop_bodies_once",
    ):
        assert key in report
    # every estimate carries the calibration's band; XLA's count beside ours counted its way
    assert report["est_step_time_band_s"] == pytest.approx(
        calibration.step_band(report["est_step_time_s"], report["roofline_step_time_s"])
    )
    assert (
        abs(report["cost_analysis_flops_per_chip"] / report["est_flops_loop_bodies_once"] - 1) < 0.1
    )
    assert report["fits"] and 0 < report["per_chip_bytes"] < report["usable_hbm_bytes"]
    # The compiler's own figure, near the published HBM (v5e 15.75 of 16 GiB; v5p 95.74 GiB
    # against the 95 GiB Cloud publishes)
    assert abs(report["usable_hbm_bytes"] / report["hbm_bytes"] - 1) < 0.03
    assert report["top_buffers"] and report["top_buffers"][0]["bytes"] > 0
    # The predictive estimate prices HBM traffic and exposed collectives: slower than the bound.
    assert 0 < report["est_mfu_pct"] <= report["roofline_mfu_pct"] <= 100
    assert 0 <= report["in_loop_all_gather_overlap_pct"] <= 100
    # The recipe does not remat, so the executed matmuls are the analytic 6N + attention
    # (under cp2: splash, whose causal skipping and backward's recompute of q k^T nearly
    # cancel; its kernels are a third of the count at 1024 tokens. Without cp the 64-token
    # validation makes `auto` pick xla).
    assert report["attention"] == ("splash" if cp else "xla")
    assert (
        report["attention_kernel_flops_per_step"] > 0.3 * report["analytic_flops_per_step"]
    ) == cp
    assert abs(report["flops_per_step"] / report["analytic_flops_per_step"] - 1) < 0.1
    # XLA's own count sees the scanned layers once: several times fewer FLOPs.
    assert report["cost_analysis_flops_per_chip"] * report["chips"] < (
        0.5 * report["analytic_flops_per_step"]
    )
    found = report["collectives"]
    assert any(
        c["op"] == "all-gather" and c["dtype"] == "bf16" and c["in_layer_loop"] for c in found
    )
    assert (
        sum(
            c["bytes_per_step"]
            for c in found
            if c["dtype"] == "f32" and c["op"] in ("all-reduce", "reduce-scatter")
        )
        > 1e6
    )  # fp32 gradients
    out = capsys.readouterr().out
    assert "fits" in out and "by the calibration's worst residuals" in out
    if extra == HSDP_OVER_DCN:
        assert report["chips"] == 8 and report["mesh"]["dp_replicate"] == 2
        dcn = [c for c in report["collectives"] if c["network"] == "dcn"]
        assert {(c["op"], c["dtype"]) for c in dcn} >= {("all-reduce", "f32")}
        assert not any(c["op"] == "all-gather" for c in dcn)  # FSDP's gathers stay in a slice
        assert report["dcn_s"] > 0


@needs_libtpu
@pytest.mark.slow
def test_a_recipe_that_cannot_fit_says_so_with_numbers(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert (
        main(
            [
                "compile",
                "--config",
                "configs/qwen3_32b.toml",
                "--topology",
                "v5e-4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["fits"] is False
    assert report["per_chip_bytes"] > report["hbm_bytes"] == 16 * 2**30
    # 32.8B fp32 parameters + AdamW's two moments (12 bytes each) over 4 chips: ~98 GB.
    assert report["memory"]["argument_size_in_bytes"] > 90e9
    assert "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.parametrize("implementation", ["jit", "shard_map"])
def test_lowered_step_flops_equal_the_analytic_count_on_both_fsdp_paths(implementation):
    """shard_map bodies see one device's shapes: their FLOPs are scaled back to the global
    count; the scanned layers' loop is read through the body's sharding annotations."""
    import jax
    from tiny_model import TINY

    from titan_jax.config import load_config
    from titan_jax.planner import inspect_step
    from titan_jax.train.trainer import build_trainer

    config = load_config(
        None,
        [
            "--parallelism.data_parallel_shard_degree",
            "4",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.fsdp_implementation",
            implementation,
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--activation_checkpoint.mode",
            "none",
            "--training.mixed_precision_param",
            "float32",
        ],
    )
    trainer = build_trainer(config, jax.devices()[:8], model_args=TINY)
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    flops, unknown = hlo_stats.dot_flops(hlo_stats.parse(lowered.as_text(dialect="hlo")))
    analytic = trainer.plan.flops_per_token() * trainer.plan.tokens_per_step
    assert unknown == 0 and abs(flops / analytic - 1) < 0.02


def test_a_quantized_run_quotes_its_mfu_against_the_low_precision_peak_beside_bf16s():
    from titan_jax.planner.aot_compile import _low_precision_mfu

    report = {"analytic_flops_per_step": 8 * 918e12 * 0.5, "est_step_time_s": 1.0}
    chip = topology.CHIPS["v6e"]  # int8 at twice bf16's 918 TFLOP/s
    assert _low_precision_mfu(report, "int8", chip, 8) == {
        "low_precision_peak": "int8",
        "est_mfu_low_precision_pct": pytest.approx(25.0),
    }
    assert _low_precision_mfu(report, "none", chip, 8) == {}
    assert _low_precision_mfu(report, "fp8", chip, 8) == {}  # no fp8 peak published for v6e


def test_a_moe_report_says_what_routing_it_assumed_and_its_one_rank_bound():
    from titan_jax.planner.aot_compile import _moe_estimate_lines

    fast = {
        "expected": True,
        "seconds": 0.01,
        "executions": 94,
        "others": [{"seconds": 0.03}],
    }  # the dropless fallback costs 20 ms more a layer
    guard = {"expected": True, "seconds": 0.02, "executions": 1, "others": [{"seconds": 0.0}]}
    report = {
        "est_routed_rows_per_device": 32768,
        "est_conditionals": [fast, guard],
        "est_all_to_one_rank_step_time_s": 17.3,
    }
    (line,) = _moe_estimate_lines(report)
    assert "32768 rows per device" in line and "1 conditionals" in line
    assert "+1880.0 ms" in line and "one rank: step 17300.0 ms" in line
    (line,) = _moe_estimate_lines({**report, "est_all_to_one_rank_step_time_s": None})
    assert "routing moves no work" in line
    assert _moe_estimate_lines({"est_routed_rows_per_device": None}) == []
