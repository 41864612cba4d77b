"""Every path and field the CLI accepts, probed as a hostile user would, one class of input per
test: missing, unreadable, of the wrong kind, corrupt, out of range. Each must end with one
line `titan-jax: error: ...` naming the file or field, exit 2, and leave every file as it was."""

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from damaged_inputs import write_damaged_inputs
from tiny_model import TINY

from titan_jax.cli import main
from titan_jax.data import paths
from titan_jax.models.qwen3 import build_model_def
from titan_jax.train import preflight
from titan_jax.train.model_io import save_orbax

TRAIN = ["train", "--config", "configs/qwen3_debug.toml", "--training.seq_len", "16"]


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def orbax_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny"
    save_orbax(path, build_model_def(TINY).init(jax.random.key(0)), TINY)
    return path


def _files(tmp: Path, orbax_model: Path) -> None:
    """What the cases point at: files of every kind, some of them damaged."""
    write_damaged_inputs(tmp)
    (tmp / "run" / "checkpoint" / "hf-10").mkdir(parents=True)
    (tmp / "run_metrics" / "metrics.jsonl").mkdir(parents=True)
    (tmp / "run_tb").mkdir()
    (tmp / "run_tb" / "tb").write_text("")
    shutil.copytree(orbax_model, tmp / "truncated")
    for f in (tmp / "truncated" / "params").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:100])
    shutil.copytree(orbax_model, tmp / "flipped")  # orbax alone restores it without a word
    biggest = max((tmp / "flipped" / "params").rglob("d/*"), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(
        b ^ 0xFF for b in data[len(data) // 2 :][:64]
    )
    biggest.write_bytes(bytes(data))


def _check(tmp_path, capsys, argv, message):
    before = snapshot(tmp_path)
    assert main([a.replace("TMP", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("titan-jax: error: ") and err.count("\n") == 1, err
    assert message.replace("TMP", str(tmp_path)) in err, err
    assert snapshot(tmp_path) == before  # nothing written, nothing lost


PIPELINE_2 = ["--parallelism.pipeline_parallel_degree", "2"]
ONE_F_ONE_B = ["--parallelism.pipeline_parallel_schedule", "1f1b"]
LONG = "a" * 300
TOO_LONG = "the name aaaaaaaaaaaa...aaaa is 300 bytes, longer than the 255 bytes a file name may"
CASES = {
    "missing": [
        (["--model.tokenizer_path", "TMP/nope"], "tokenizer path 'TMP/nope': no tokenizer.json"),
        (
            ["--training.dataset", "text", "--training.dataset_path", "TMP/nope.txt"],
            "dataset_path='TMP/nope.txt' does not exist",
        ),
        (
            ["--checkpoint.initial_load_path", "TMP/nope"],
            "checkpoint.initial_load_path=TMP/nope does not exist",
        ),
    ],
    "unreadable": [  # /proc/self/mem fails to read (EIO) even for root, unlike chmod
        (
            ["--training.dataset", "jsonl", "--training.dataset_path", "/proc/self/mem"],
            "/proc/self/mem cannot be read: ",
        ),
        (
            ["--model.tokenizer_path", "/proc/self/mem"],
            "tokenizer file '/proc/self/mem' cannot be read: Input/output error",
        ),
    ],
    "wrong kind": [
        (
            ["--job.dump_folder", "TMP/file/run"],
            "job.dump_folder=TMP/file/run lies under TMP/file, which is a file, not a folder",
        ),
        (["--job.dump_folder", "TMP/run_metrics"], "TMP/run_metrics/metrics.jsonl is not a file"),
        (
            ["--job.dump_folder", "TMP/run_tb", "--metrics.enable_tensorboard", "true"],
            "metrics.save_tb_folder=TMP/run_tb/tb is a file, not a folder",
        ),
        (
            [
                "--job.dump_folder",
                "TMP/x",
                "--checkpoint.enable",
                "true",
                "--checkpoint.folder",
                "TMP/file",
            ],
            "checkpoint.folder=TMP/file is a file, not a folder",
        ),
        (
            ["--training.dataset", "jsonl", "--training.dataset_path", "/dev/null"],
            "dataset_path='/dev/null' is neither a regular file nor a folder",
        ),
        (
            ["--checkpoint.initial_load_path", "TMP/hf"],
            "checkpoint.initial_load_path=TMP/hf is a "
            "HF model directory (config.json + safetensors); add --checkpoint.initial_load_in_hf",
        ),
        (
            ["--checkpoint.initial_load_path", "TMP/file"],
            "checkpoint.initial_load_path=TMP/file is a file",
        ),
        (
            [
                "--job.dump_folder",
                "TMP/run",
                "--training.steps",
                "10",
                "--checkpoint.enable",
                "true",
                "--checkpoint.last_save_in_hf",
                "true",
            ],
            "checkpoint.last_save_in_hf: TMP/run/checkpoint/hf-10 already exists",
        ),
        (
            ["--moe.load_balance_coeff", "0.01"],
            "moe.load_balance_coeff=0.01 applies to MoE flavours only; model.flavor=debugmodel is "
            "dense",
        ),
    ],
    "corrupt": [
        (
            ["--training.dataset", "parquet", "--training.dataset_path", "TMP/bad_footer.parquet"],
            "TMP/bad_footer.parquet: not a parquet file (Parquet magic bytes not found",
        ),
        (
            ["--training.dataset", "parquet", "--training.dataset_path", "TMP/bad_pages.parquet"],
            "TMP/bad_pages.parquet: column 'text' is corrupt",
        ),
        (
            ["--model.tokenizer_path", "TMP/latin1.json"],
            "tokenizer file 'TMP/latin1.json' is not UTF-8 text (byte 5)",
        ),
    ],
    "too long": [  # a name past the file system's 255 bytes: one line, nothing created
        (["--job.dump_folder", f"TMP/{LONG}/run"], f"job.dump_folder=TMP/{LONG}/run: {TOO_LONG}"),
        (
            [
                "--job.dump_folder",
                "TMP/x",
                "--checkpoint.enable",
                "true",
                "--checkpoint.folder",
                LONG,
            ],
            f"checkpoint.folder=TMP/x/{LONG}: {TOO_LONG}",
        ),
    ],
    "url": [  # refused at once: no network reached, no local folder named "gs:" made
        (
            ["--training.dataset", "jsonl", "--training.dataset_path", "hdfs://nn/x.jsonl"],
            "hdfs://nn/x.jsonl: hdfs:// is not supported; titan-jax takes local paths, file://, "
            "gs://",
        ),
        (
            ["--training.dataset", "jsonl", "--training.dataset_path", "s3://bucket/x.jsonl"],
            "s3://bucket/x.jsonl: s3:// needs a package that is not installed (Install s3fs",
        ),
        (
            [
                "--training.dataset",
                "jsonl",
                "--training.dataset_path",
                "http://127.0.0.1:9/x.jsonl",
            ],
            "dataset_path='http://127.0.0.1:9/x.jsonl' cannot be read: ",
        ),
        (
            ["--checkpoint.initial_load_path", "gs://bucket/ckpt"],
            "checkpoint.initial_load_path gs://bucket/ckpt: a URL, and "
            "checkpoint.initial_load_path takes a local path; copy it to a local folder first",
        ),
    ],
    "out of range": [
        (
            [
                "--distributed.num_processes",
                "2",
                "--distributed.process_id",
                "0",
                "--distributed.coordinator_address",
                "localhost:70000",
            ],
            "distributed.coordinator_address='localhost:70000': port 70000 is not a TCP port",
        ),
        (["--distributed.step_timeout", "-1"], "distributed.step_timeout=-1 must be >= 0"),
        (
            PIPELINE_2
            + ["--parallelism.pipeline_parallel_schedule", "interleaved"]
            + ["--parallelism.pipeline_parallel_virtual_stages", "3"],
            "pipeline_parallel_degree=2 x pipeline_parallel_virtual_stages=3 = 6 chunks do not "
            "divide the model's 8 layers",
        ),
        (
            [*PIPELINE_2, "--parallelism.pipeline_parallel_microbatches", "1"],
            "pipeline_parallel_microbatches=1 is fewer than the 2 stages; use at least 2",
        ),
        (
            [*PIPELINE_2, "--parallelism.fsdp_lookahead_gather", "true"],
            "fsdp_lookahead_gather cannot run under pipeline_parallel_degree=2",
        ),
        (
            [*PIPELINE_2, *ONE_F_ONE_B, "--parallelism.pipeline_parallel_virtual_stages", "2"],
            "pipeline_parallel_virtual_stages=2 needs pipeline_parallel_schedule=interleaved "
            "(1f1b holds one chunk a stage",
        ),
        (
            [*PIPELINE_2, *ONE_F_ONE_B, "--parallelism.tensor_parallel_degree", "2"]
            + ["--parallelism.fsdp_implementation", "shard_map"],
            "pipeline_parallel_schedule=1f1b with tensor_parallel_degree=2 needs "
            "parallelism.fsdp_implementation=jit",
        ),
        (
            ["--distributed.heartbeat_timeout", "0"],
            "distributed.heartbeat_timeout=0 must be >= 1 seconds",
        ),
        (
            ["--lora.rank", "8", "--lora.target_modules", "experts"],
            "lora.target_modules='experts' matches no projection of model.flavor=debugmodel, "
            "which is dense (it has no experts); name some of attention,mlp,q_proj,",
        ),
    ],
}


@pytest.mark.parametrize("kind", CASES)
def test_train_inputs(tmp_path, capsys, orbax_model, kind):
    _files(tmp_path, orbax_model)
    for args, message in CASES[kind]:
        dump = [] if "--job.dump_folder" in args else ["--job.dump_folder", "TMP/out"]
        _check(tmp_path, capsys, [*TRAIN, *dump, *args], message)
        assert not (tmp_path / "out").exists()


GENERATE = ["generate", "--config", "configs/qwen3_debug.toml", "--checkpoint"]
OTHER_CASES = [
    ([*GENERATE, "TMP/file", "--prompt", "x"], "--checkpoint TMP/file is a file"),
    (
        [*GENERATE, "TMP/tiny", "--prompt", "x", "--max-new-tokens", "70"],
        "--prompt of 1 tokens plus --max-new-tokens 70 exceeds the model's 64 positions; lower "
        "--max-new-tokens to 63",
    ),
    ([*GENERATE, "TMP/tiny", "--prompt", "x", "--seed", str(2**70)], "--seed 118059162071741130"),
    (
        [*GENERATE, "TMP/tiny", "--prompt", "x", "--temperature", "nan"],
        "--temperature nan must be a number >= 0",
    ),
    ([*GENERATE, "TMP/tiny", "--prompt", "caf\udce9"], "--prompt is not UTF-8 text (character 3)"),
    (
        ["convert", "--from", "orbax", "--to", "hf", "TMP/tiny", "TMP/file/out"],
        "destination TMP/file/out lies under TMP/file, which is a file",
    ),
    (
        ["convert", "--from", "orbax", "--to", "hf", "TMP/tiny", f"TMP/{LONG}"],
        f"destination TMP/{LONG}: {TOO_LONG}",
    ),
    (
        ["prepare-data", "--config", "configs/qwen3_debug.toml", "--output", f"TMP/{LONG}"],
        f"--output=TMP/{LONG}: {TOO_LONG}",
    ),
    (
        [
            "convert",
            "--from",
            "orbax",
            "--to",
            "hf",
            "TMP/tiny",
            "TMP/out",
            "--max-shard-size",
            "0",
        ],
        "--max-shard-size '0' must be at least 1 byte",
    ),
    (
        ["convert", "--from", "orbax", "--to", "hf", "TMP/truncated", "TMP/out"],
        "orbax model TMP/truncated is unreadable (corrupt or truncated): OUT_OF_RANGE",
    ),
    (
        ["convert", "--from", "orbax", "--to", "hf", "TMP/flipped", "TMP/out"],
        "orbax model TMP/flipped is corrupt: tok_embeddings does not match the checksum recorded "
        "when it was written; convert it again from its source",
    ),
    (
        [*GENERATE, "gs://bucket/run/checkpoint", "--prompt", "x"],
        "--checkpoint gs://bucket/run/checkpoint: a URL, and --checkpoint takes a local path",
    ),
    (
        ["convert", "--from", "hf", "--to", "orbax", "TMP/hf", "TMP/out", "--dtype", "bfloat16"],
        "--dtype bfloat16 applies to --to hf and peft only",
    ),
    (
        ["convert", "--from", "orbax", "--to", "hf", "TMP/tiny", "gs://bucket/out"],
        "DST gs://bucket/out: a URL, and DST takes a local path",
    ),
    (
        ["inspect", "--config", "configs/qwen3_debug.toml", "--json", "TMP/folder"],
        "--json TMP/folder is a folder",
    ),
    (
        [
            "compile",
            "--config",
            "configs/qwen3_debug.toml",
            "--topology",
            "v5p-8",
            "--json",
            "TMP/nope/r.json",
        ],
        "--json TMP/nope/r.json: folder TMP/nope does not exist",
    ),
    (
        ["parity", "--config", "configs/qwen3_debug.toml", "--seq-len", "5000"],
        "--seq-len 5000 must be in [1, 4064]: model.flavor=debugmodel's 4096 positions less the 32 "
        "greedy tokens",
    ),
]


def test_generate_convert_and_report_inputs(tmp_path, capsys, orbax_model):
    _files(tmp_path, orbax_model)
    shutil.copytree(orbax_model, tmp_path / "tiny")
    for argv, message in OTHER_CASES:
        _check(tmp_path, capsys, argv, message)
    assert not Path("gs:").exists()  # a URL was never taken for a local folder


@pytest.fixture
def no_dns(monkeypatch):
    """A machine that cannot resolve Cloud Storage's host (as this sandbox, whatever the
    machine the tests run on)."""

    def unresolved(*_, **__):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    class NoCloudStorage:  # gcsfs would retry for a minute: it must never be asked
        def __init__(self, *_, **__):
            raise AssertionError("gcsfs was asked for a bucket this machine cannot reach")

    monkeypatch.setattr(paths.socket, "getaddrinfo", unresolved)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    for scheme in ("gs", "gcs"):
        monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, scheme, NoCloudStorage)
    paths.cloud_storage_unreachable.cache_clear()
    yield
    paths.cloud_storage_unreachable.cache_clear()


@pytest.mark.parametrize(
    "argv,url",
    [
        (
            ["prepare-data", "--config", "configs/qwen3_debug.toml", "--output", "gs://b/store"],
            "gs://b/store",
        ),
        ([*TRAIN, "--job.dump_folder", "gs://b/run"], "gs://b/run"),
        (
            [
                *TRAIN,
                "--job.dump_folder",
                "TMP/run",
                "--training.dataset",
                "tokens",
                "--training.dataset_path",
                "gs://b/store",
            ],
            "gs://b/store/manifest.json",
        ),
    ],
)
def test_a_bucket_this_machine_cannot_reach_is_one_line_at_once(
    tmp_path, capsys, no_dns, argv, url
):
    """(gcsfs retried for a minute or more, then printed tracebacks.)"""
    _check(
        tmp_path,
        capsys,
        argv,
        f"{url}: Cloud Storage (storage.googleapis.com) cannot be "
        "reached from this machine (Name or service not known); use a local path",
    )


def test_a_run_folder_that_is_a_broken_symlink_is_named(tmp_path, capsys):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    assert main([*TRAIN, "--job.dump_folder", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"titan-jax: error: job.dump_folder={tmp_path}/run: {tmp_path}/run is a "
        f"broken symbolic link (to {tmp_path}/gone); remove it, or make it point at "
        "a folder\n"
    ), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_missing_mixture_store_is_named_as_the_mixture_path(tmp_path, capsys):
    recipe = tmp_path / "mix.toml"
    recipe.write_text(
        f'[model]\nflavor = "debugmodel"\n[training]\nseq_len = 16\n'
        f'[[training.mixture]]\npath = "{tmp_path}/nope"\n'
    )
    _check(
        tmp_path,
        capsys,
        ["train", "--config", str(recipe), "--job.dump_folder", "TMP/out"],
        "training.mixture.path: TMP/nope is not a token store (no manifest.json)",
    )


def test_an_unwritable_metrics_file_is_named_before_anything_runs(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("")
    real = os.access
    monkeypatch.setattr(
        preflight.os,
        "access",
        lambda p, mode: real(p, mode) and (Path(p).name != "metrics.jsonl" or not mode & os.W_OK),
    )  # root writes anything
    from titan_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="metrics.jsonl is not writable: Permission denied"):
        preflight.check_outputs(load_config(None, ["--job.dump_folder", str(tmp_path)]))


def test_an_override_value_that_looks_like_a_flag_is_a_value(capsys):
    assert main(["train", "--job.description", "-hello", "--print-config"]) == 0
    assert 'description = "-hello"' in capsys.readouterr().out


def test_compile_never_needs_libtpus_lockfile(tmp_path):
    """Another process holds libtpu's TPU lock (as a training job on this TPU VM would): the
    compile-only load `titan-jax compile` makes still gets its devices."""
    env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from jax.experimental import topologies\n"
            "topologies.get_topology_desc(platform='tpu', topology_name='v5e:2x2')\n"
            "print('held', flush=True)\nimport time\ntime.sleep(120)",
        ],
        env={**env, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"  # or another process held it first
        assert Path("/tmp/libtpu_lockfile").exists()
        start = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "from titan_jax import jax_platform\n"
                "jax_platform.compile_only_libtpu()\n"
                "from titan_jax.planner.topology import compile_only_devices, parse_slice\n"
                "print(len(compile_only_devices(parse_slice('v5e-4'))))",
            ],
            env={k: v for k, v in env.items() if k != "JAX_PLATFORMS"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "4", proc.stderr[-2000:]
        assert time.monotonic() - start < 60
    finally:
        holder.kill()
        holder.wait()


def test_the_cli_loads_libtpu_compile_only_for_compile(monkeypatch, capsys):
    monkeypatch.delenv("ALLOW_MULTIPLE_LIBTPU_LOAD", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")  # as on a TPU VM
    assert main(["compile", "--topology", "v9x-1"]) == 2  # stops at the slice name
    assert "is not a TPU slice titan-jax knows" in capsys.readouterr().err
    assert os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1" and os.environ["JAX_PLATFORMS"] == "cpu"
