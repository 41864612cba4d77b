"""Every bad-input probe of issues #21 and #32, each through the CLI in a fresh process.

For each: the exit code, the whole stderr (the one line it must be, or what else came), and
whether a watched folder changed (the run's own log, `titan-jax.log`, aside). Exit code 1 if any
probe is not one line, exit 2, nothing changed. The in-process tests (tests/test_bad_input.py
and others) assert the same; this also sees what a process prints at exit.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu .venv/bin/python scripts/probe_bad_input.py [NAME ...]

It builds its fixtures in a temporary folder first (a tiny orbax model, and a 2-step debug run
with a full checkpoint: about a minute on two cores). `NAME`s pick probes by substring.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the damaged files, shared with tests/test_bad_input.py
CFG = str(ROOT / "configs" / "qwen3_debug.toml")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
QUICK = [
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "1",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.progress_bar",
    "false",
    "--validation.enable",
    "false",
]
TRAIN = ["train", "--config", CFG, "--training.steps", "1", *QUICK]
RESUME = [
    "train",
    "--config",
    CFG,
    "--training.steps",
    "3",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
    *QUICK,
]
GENERATE = ["generate", "--config", CFG, "--checkpoint"]
CONVERT = ["convert", "--from", "orbax", "--to", "hf"]


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_jax.cli", *argv],
        env=ENV,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _fixtures(t: Path) -> None:
    import jax
    from damaged_inputs import write_damaged_inputs

    from titan_jax.models.qwen3 import Qwen3Args, build_model_def
    from titan_jax.train.model_io import save_orbax

    args = Qwen3Args(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=64,
        vocab_size=2048,
        max_seq_len=64,
    )
    save_orbax(t / "model", build_model_def(args).init(jax.random.key(0)), args)
    run = _cli(
        [
            *RESUME[:4],
            "2",
            *RESUME[5:],
            "--checkpoint.last_save_model_only",
            "false",
            "--job.dump_folder",
            str(t / "run"),
        ],
        t,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    write_damaged_inputs(t)
    (t / "tb_run").mkdir()
    (t / "tb_run" / "tb").write_text("")
    (t / "export" / "checkpoint" / "hf-1").mkdir(parents=True)
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": [1, 2, 3]}).save_to_disk(str(t / "hf_int"))
    datasets.Dataset.from_dict({"text": ["a b", "c d"]}).save_to_disk(str(t / "hf_state"))
    (t / "hf_state" / "state.json").write_text("{broken")
    for name in ("history", "bad_data_state", "truncated"):
        shutil.copytree(t / "run", t / name)
    for f in (t / "bad_data_state" / "checkpoint" / "2" / "data").rglob("*"):
        if f.is_file():
            f.write_text('{"version": 99}')
    for f in (t / "truncated" / "checkpoint" / "2" / "state" / "d").iterdir():
        f.write_bytes(f.read_bytes()[:10])
    shutil.copytree(t / "model", t / "damaged_model")
    for f in (t / "damaged_model" / "params" / "d").iterdir():
        f.unlink()
    _round_three_fixtures(t)


def _round_three_fixtures(t: Path) -> None:
    """Issue #32's inputs: HF directories with tampered config.json numbers, token stores with
    a cut manifest or ids past the vocabulary, a mixture whose weights overflow."""
    import json

    import numpy as np

    from titan_jax.models.qwen3 import QWEN3, hf
    from titan_jax.train.model_io import load_orbax

    args, params = load_orbax(t / "model", QWEN3)
    hf.save_hf(t / "hf_model", params, args)
    config = json.loads((t / "hf_model" / "config.json").read_text())
    for name, change in (
        ("hf_layers", {"num_hidden_layers": 10**9}),
        ("hf_theta", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e400}}),
        ("hf_kv0", {"num_key_value_heads": 0}),
    ):
        shutil.copytree(t / "hf_model", t / name)
        (t / name / "config.json").write_text(json.dumps({**config, **change}))
    (t / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i} " + "w " * 30}) + "\n" for i in range(60))
    )
    out = _cli(
        [
            "prepare-data",
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            str(t / "corpus.jsonl"),
            "--output",
            str(t / "store"),
        ],
        t,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    shutil.copytree(t / "store", t / "cut_manifest")
    manifest = t / "cut_manifest" / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    shutil.copytree(t / "store", t / "bad_ids")
    shard = t / "bad_ids" / "tokens-00000.bin"
    tokens = np.fromfile(shard, "<u2")
    tokens[::7] = 65000  # in every window a step may read
    tokens.tofile(shard)
    (t / "mixture.toml").write_text(
        (ROOT / "configs" / "qwen3_debug.toml").read_text()
        + f'\n[[training.mixture]]\npath = "{t / "store"}"\nweight = 1e308\n'
        + f'\n[[training.mixture]]\npath = "{t / "store"}"\nweight = 1e308\n'
    )


# (name, argv, folder that must not change); T stands for the fixtures' folder.
PROBES = [
    (
        "another run's history, checkpointing off",
        [*TRAIN, "--job.dump_folder", "T/history", "--checkpoint.enable", "false"],
        "T/history",
    ),
    ("dump folder ''", [*TRAIN, "--job.dump_folder", ""], "T/cwd"),
    ("dump folder .", [*TRAIN, "--job.dump_folder", "."], "T/cwd"),
    (
        "a resume with a bad data state",
        [*RESUME, "--job.dump_folder", "T/bad_data_state"],
        "T/bad_data_state",
    ),
    (
        "a shared absolute checkpoint.folder",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/second",
            "--checkpoint.enable",
            "true",
            "--checkpoint.folder",
            "T/shared",
        ],
        "T/shared",
    ),
    (
        "parquet with a bad footer",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o1",
            "--training.dataset",
            "parquet",
            "--training.dataset_path",
            "T/bad_footer.parquet",
        ],
        None,
    ),
    (
        "parquet with bad data pages",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o2",
            "--training.dataset",
            "parquet",
            "--training.dataset_path",
            "T/bad_pages.parquet",
        ],
        None,
    ),
    (
        "a tokenizer that is not UTF-8",
        [*TRAIN, "--job.dump_folder", "T/o3", "--model.tokenizer_path", "T/latin1.json"],
        None,
    ),
    (
        "a dataset file that cannot be read",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o4",
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            "/proc/self/mem",
        ],
        None,
    ),
    (
        "hf_disk text column of another type",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o5",
            "--training.dataset",
            "hf_disk",
            "--training.dataset_path",
            "T/hf_int",
        ],
        None,
    ),
    (
        "hf_disk with a corrupt state.json",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o6",
            "--training.dataset",
            "hf_disk",
            "--training.dataset_path",
            "T/hf_state",
        ],
        None,
    ),
    (
        "a TensorBoard folder that is a file",
        [*TRAIN, "--job.dump_folder", "T/tb_run", "--metrics.enable_tensorboard", "true"],
        "T/tb_run",
    ),
    ("inspect --json naming a folder", ["inspect", "--config", CFG, "--json", "T/folder"], None),
    (
        "compile --json naming a folder",
        ["compile", "--config", CFG, "--topology", "v5e-4", "--json", "T/folder"],
        None,
    ),
    ("convert into a path under a file", [*CONVERT, "T/model", "T/file/out"], None),
    ("convert of a damaged orbax model", [*CONVERT, "T/damaged_model", "T/out"], "T/damaged_model"),
    ("convert --max-shard-size 0", [*CONVERT, "T/model", "T/out", "--max-shard-size", "0"], None),
    ("generate with a file as --checkpoint", [*GENERATE, "T/file", "--prompt", "x"], None),
    (
        "generate beyond the model's positions",
        [*GENERATE, "T/model", "--prompt", "x", "--max-new-tokens", "70"],
        None,
    ),
    (
        "generate with a huge --seed",
        [*GENERATE, "T/model", "--prompt", "x", "--seed", str(2**70)],
        None,
    ),
    (
        "generate with a prompt that is not UTF-8",
        [*GENERATE, "T/model", "--prompt", "caf\udce9"],
        None,
    ),
    (
        "generate --temperature nan",
        [*GENERATE, "T/model", "--prompt", "x", "--temperature", "nan"],
        None,
    ),
    (
        "a resume from a truncated checkpoint",
        [*RESUME, "--job.dump_folder", "T/truncated"],
        "T/truncated",
    ),
    (
        "[moe] keys on a dense model",
        [*TRAIN, "--job.dump_folder", "T/o7", "--moe.load_balance_coeff", "0.01"],
        None,
    ),
    (
        "parity --seq-len beyond the positions",
        ["parity", "--config", CFG, "--seq-len", "5000"],
        None,
    ),
    (
        "a coordinator port above 65535",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o8",
            "--distributed.num_processes",
            "2",
            "--distributed.process_id",
            "0",
            "--distributed.coordinator_address",
            "localhost:70000",
        ],
        None,
    ),
    (
        "/dev/null as a dataset path",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o9",
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            "/dev/null",
        ],
        None,
    ),
    (
        "a HF directory as initial_load_path",
        [*TRAIN, "--job.dump_folder", "T/o10", "--checkpoint.initial_load_path", "T/hf"],
        None,
    ),
    (
        "a last_save_in_hf folder that exists",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/export",
            "--checkpoint.enable",
            "true",
            "--checkpoint.last_save_in_hf",
            "true",
        ],
        "T/export",
    ),
    # Issue #32: numbers read but not checked, damaged stores, prepare-data, folders.
    (
        "config.json with 10**9 layers",
        ["convert", "--from", "hf", "--to", "orbax", "T/hf_layers", "T/out_layers"],
        "T/hf_layers",
    ),
    (
        "config.json with an infinite rope_theta",
        ["convert", "--from", "hf", "--to", "orbax", "T/hf_theta", "T/out_theta"],
        None,
    ),
    (
        "config.json with zero KV heads",
        ["convert", "--from", "hf", "--to", "orbax", "T/hf_kv0", "T/out_kv0"],
        None,
    ),
    (
        "yarn_beta_fast 0",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o11",
            "--model.rope_type",
            "yarn",
            "--model.yarn_beta_fast",
            "0",
        ],
        None,
    ),
    (
        "yarn ramp inverted",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o12",
            "--model.rope_type",
            "yarn",
            "--model.yarn_beta_fast",
            "1",
            "--model.yarn_beta_slow",
            "8",
        ],
        None,
    ),
    (
        "a yarn factor past int32 positions",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o13",
            "--model.rope_type",
            "yarn",
            "--model.yarn_factor",
            "1e300",
        ],
        None,
    ),
    (
        "mixture weights that overflow",
        [
            "train",
            "--config",
            "T/mixture.toml",
            "--training.steps",
            "1",
            *QUICK,
            "--job.dump_folder",
            "T/o14",
        ],
        None,
    ),
    (
        "an unknown training.dataset",
        [*TRAIN, "--job.dump_folder", "T/o15", "--training.dataset", "csv"],
        None,
    ),
    (
        "save_tb_folder climbing out",
        [*TRAIN, "--job.dump_folder", "T/o16", "--metrics.save_tb_folder", "../../tb"],
        None,
    ),
    (
        "save_traces_folder climbing out",
        [*TRAIN, "--job.dump_folder", "T/o17", "--profiling.save_traces_folder", "../x"],
        None,
    ),
    (
        "prepare-data --verify of a cut manifest",
        ["prepare-data", "--output", "T/cut_manifest", "--verify"],
        "T/cut_manifest",
    ),
    (
        "training on a store with ids past the vocabulary",
        [
            *TRAIN,
            "--job.dump_folder",
            "T/o18",
            "--training.dataset",
            "tokens",
            "--training.dataset_path",
            "T/bad_ids",
        ],
        "T/bad_ids",
    ),
    (
        "prepare-data --workers 3000000000",
        [
            "prepare-data",
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            "T/corpus.jsonl",
            "--output",
            "T/store2",
            "--workers",
            "3000000000",
        ],
        None,
    ),
    (
        "prepare-data into a path under a file",
        [
            "prepare-data",
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            "T/corpus.jsonl",
            "--output",
            "T/file/store",
        ],
        None,
    ),
    ("an s3:// run folder", [*TRAIN, "--job.dump_folder", "s3://bucket/runs/8b"], "T/cwd"),
    ("a gs:// checkpoint folder", [*TRAIN, "--checkpoint.folder", "gs://bucket/ckpt"], "T/cwd"),
    ("a memory:// run folder", [*TRAIN, "--job.dump_folder", "memory://runs/x"], "T/cwd"),
    (
        "parity trajectory with a document mask",
        ["parity", "--config", CFG, "--trajectory-steps", "2", "--training.document_mask", "true"],
        None,
    ),
]


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.name != "titan-jax.log"
    }


def _probe(t: Path, name: str, argv: list[str], watch: str | None) -> bool:
    argv = [a.replace("T/", f"{t}/") for a in argv]
    folder = Path(watch.replace("T/", f"{t}/")) if watch else None
    holder = None
    if "shared" in name:  # another run holds the checkpoint folder's lock
        (t / "shared").mkdir(exist_ok=True)
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import fcntl, os, socket, sys, time\n"
                f"f = open({str(t / 'shared' / '.titan-jax.lock')!r}, 'w')\n"
                "fcntl.flock(f, fcntl.LOCK_EX)\n"
                "f.write(f'{socket.gethostname()} pid {os.getpid()}'); f.flush()\n"
                "print('held', flush=True); time.sleep(600)",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        holder.stdout.readline()
    before = _snapshot(folder) if folder else None
    start = time.monotonic()
    try:
        out = _cli(argv, t / "cwd")
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    lines = [line for line in out.stderr.splitlines() if not line.startswith("WARNING ")]
    changed = folder is not None and _snapshot(folder) != before
    ok = (
        out.returncode == 2
        and len(lines) == 1
        and lines[0].startswith("titan-jax: error: ")
        and not changed
    )
    print(
        f"{'ok ' if ok else 'BAD'} {name}: exit {out.returncode}, "
        f"{time.monotonic() - start:.0f} s{', FILES CHANGED' if changed else ''}"
    )
    for line in lines if not ok else lines[:1]:
        print(f"    {line[:300]}")
    return ok


def main(names: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="titan-jax-probes-") as tmp:
        t = Path(tmp)
        (t / "cwd").mkdir()
        _fixtures(t)
        results = [
            _probe(t, name, argv, watch)
            for name, argv, watch in PROBES
            if not names or any(n in name for n in names)
        ]
    print(f"{sum(results)} of {len(results)} probes ok")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
