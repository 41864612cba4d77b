import json

import jax
import pytest
from tokenizers import Tokenizer, models

from titan_jax.cli import main

FAST = [
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.plot_loss",  # test_train_writes_metrics_and_plot draws it
    "false",
]


def run_cli(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


def test_train_writes_metrics_and_plot(tmp_path, capsys, monkeypatch):
    # One device of the 8 simulated ones: the CLI cannot re-size an initialised backend.
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])
    code, out = run_cli(
        capsys,
        "train",
        "--config",
        "configs/qwen3_debug.toml",
        *FAST,
        "--training.steps",
        "4",
        "--metrics.log_freq",
        "2",
        "--metrics.progress_bar",
        "false",
        "--metrics.plot_loss",
        "true",
        "--job.dump_folder",
        str(tmp_path),
    )
    assert code == 0, out.err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu_pct", "step_time_s"):
        assert all(key in r for r in rows), key
    assert rows[1]["tokens_per_sec"] > 0 and rows[1]["mfu_pct"] > 0
    assert rows[-1]["val_loss"] > 0  # the recipe validates at the last step
    # Step 1 includes compilation: its throughput was not measured.
    assert rows[0]["tokens_per_sec"] is None and rows[0]["step_time_s"] is None
    assert [line.split()[:2] for line in out.out.splitlines() if line.startswith("step ")] == [
        ["step", "1/4"],
        ["step", "2/4"],
        ["step", "4/4"],
    ]  # plain lines without the bar
    header = json.loads((tmp_path / "metrics_header.json").read_text())
    assert header["peak_flops_method"] == "measured" and header["peak_flops_per_device"] > 1e8
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_print_config(capsys):
    code, out = run_cli(
        capsys,
        "train",
        "--config",
        "configs/qwen3_debug.toml",
        "--training.steps",
        "3",
        "--print-config",
    )
    assert code == 0
    assert "[training]" in out.out and "steps = 3" in out.out


def _big_tokenizer(path):
    vocab = {f"w{i}": i for i in range(3000)} | {"<|endoftext|>": 3000}
    Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(path))
    return path


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model.flavor", "9B"], "model.flavor='9B' is not a Qwen3 flavour"),
        (["--training.sequence_len", "8"], "unknown config key training.sequence_len"),
        (["--training.steps", "1.5"], "training.steps='1.5' is not an integer"),
        (
            ["--training.seq_len", "5000"],
            "training.seq_len=5000 exceeds the maximum sequence length",
        ),
        (
            ["--validation.enable", "true", "--validation.seq_len", "5000"],
            "validation.seq_len=5000 exceeds the maximum sequence length",
        ),
        (["--training.global_batch_size", "3"], "training.global_batch_size=3 must be a multiple"),
        (
            ["--training.dataset", "jsonl", "--training.dataset_path", "/nonexistent/x.jsonl"],
            "/nonexistent/x.jsonl",
        ),
        (["--parallelism.data_parallel_shard_degree", "3"], "= 3 but there are 8 devices"),
        (["--training.steps", "3000000000"], "training.steps=3000000000 is out of range"),
        (["--optimizer.lr", "inf"], "optimizer.lr=inf must be a finite number"),
        (["--training.seed", "-1"], "training.seed=-1 must be in [0, 2**31)"),
        (
            ["--checkpoint.folder", "../elsewhere"],
            "checkpoint.folder='../elsewhere' must name a folder inside job.dump_folder",
        ),
        (
            ["--checkpoint.enable", "true", "--checkpoint.initial_load_path", "/nonexistent/w"],
            "checkpoint.initial_load_path=/nonexistent/w does not exist",
        ),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, capsys, args, message):
    code, out = run_cli(
        capsys,
        "train",
        "--config",
        "configs/qwen3_debug.toml",
        "--job.dump_folder",
        str(tmp_path / "run"),
        *args,
    )
    assert code == 2
    assert message in out.err
    assert out.err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_empty_dataset_and_big_tokenizer(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, out = run_cli(
        capsys, "train", "--training.dataset", "jsonl", "--training.dataset_path", str(empty), *FAST
    )
    assert code == 2 and "empty.jsonl" in out.err
    code, out = run_cli(
        capsys,
        "train",
        "--model.tokenizer_path",
        str(_big_tokenizer(tmp_path / "tokenizer.json")),
        *FAST,
    )
    assert code == 2 and "vocab size 3001, larger than" in out.err


def test_a_failure_that_is_not_bad_input_keeps_its_traceback(tmp_path):
    """A RuntimeError from JAX or orbax is not disguised as bad input: traceback, exit 1."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from titan_jax import cli\n"
        "from titan_jax.train import loop\n"
        "def broken(config, devices=None, **kwargs):\n"
        "    raise RuntimeError('XLA went wrong')\n"
        "loop.train = broken\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "train", "--job.dump_folder", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "RuntimeError: XLA went wrong" in proc.stderr
    assert "titan-jax: error:" not in proc.stderr


def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys):
    config = tmp_path / "empty.toml"
    config.write_text("")
    code, out = run_cli(capsys, "train", "--config", str(config))
    assert (
        code == 2
        and out.err
        == f"titan-jax: error: config file {config} is empty; "
        "give a recipe such as configs/qwen3_debug.toml, or no --config for the defaults\n"
    )


def test_a_dump_folder_that_is_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])
    (tmp_path / "file").write_text("mine")
    code, out = run_cli(capsys, "train", *FAST, "--job.dump_folder", str(tmp_path / "file"))
    assert code == 2
    assert (
        out.err == f"titan-jax: error: job.dump_folder={tmp_path / 'file'} is a file, not a "
        "folder\n"
    )
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.slow
def test_the_moe_recipe_learns_and_logs_expert_load(tmp_path, capsys, monkeypatch):
    """configs/qwen3_debug_moe.toml through the CLI, shortened: the loss falls, and every
    logged step reports the experts' load."""
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])
    code, out = run_cli(
        capsys,
        "train",
        "--config",
        "configs/qwen3_debug_moe.toml",
        "--training.seq_len",
        "32",
        "--training.steps",
        "8",
        "--metrics.log_freq",
        "1",
        "--metrics.progress_bar",
        "false",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(tmp_path),
    )
    assert code == 0, out.err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all("moe_max_load" in r and "moe_idle_experts" in r for r in rows)
    # 7.70 -> 7.32 here (means of the first and the last three steps)
    assert sum(r["loss"] for r in rows[-3:]) < 0.97 * sum(r["loss"] for r in rows[:3])
    assert all(1 <= r["moe_max_load"] <= 64 and 0 <= r["moe_idle_experts"] < 1 for r in rows)


def test_a_compilation_cache_that_is_a_file_is_one_line_and_not_used(tmp_path, capsys, monkeypatch):
    import titan_jax.cli as cli

    before = jax.config.jax_compilation_cache_dir
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("TITAN_JAX_COMPILATION_CACHE", str(tmp_path / "cache"))
    cli._enable_compilation_cache()
    assert capsys.readouterr().err == (
        f"titan-jax: the compilation cache {tmp_path / 'cache'} is not a folder; compiling "
        "without one (set TITAN_JAX_COMPILATION_CACHE to a folder, or to '' for none)\n"
    )
    assert jax.config.jax_compilation_cache_dir == before
