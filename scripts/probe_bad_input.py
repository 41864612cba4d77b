"""Every bad-input probe of issue #21, each through the CLI in a fresh process, as a user meets it.

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
CFG = str(ROOT / "configs" / "qwen3_debug.toml")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
QUICK = ["--training.seq_len", "16", "--training.local_batch_size", "1",
         "--lr_scheduler.warmup_steps", "1", "--metrics.progress_bar", "false",
         "--validation.enable", "false"]
TRAIN = ["train", "--config", CFG, "--training.steps", "1", *QUICK]
RESUME = ["train", "--config", CFG, "--training.steps", "3", "--checkpoint.enable", "true",
          "--checkpoint.interval", "2", *QUICK]
GENERATE = ["generate", "--config", CFG, "--checkpoint"]
CONVERT = ["convert", "--from", "orbax", "--to", "hf"]


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_jax.cli", *argv], env=ENV, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _fixtures(t: Path) -> None:
    import jax
    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan_jax.models.qwen3 import Qwen3Args, build_model_def
    from titan_jax.train.model_io import save_orbax

    args = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
                     vocab_size=2048, max_seq_len=64)
    save_orbax(t / "model", build_model_def(args).init(jax.random.key(0)), args)
    run = _cli([*RESUME[:4], "2", *RESUME[5:], "--checkpoint.last_save_model_only", "false",
                "--job.dump_folder", str(t / "run")], t)
    assert run.returncode == 0, run.stderr[-2000:]
    (t / "file").write_text("a file")
    (t / "folder").mkdir()
    pq.write_table(pa.table({"text": ["hello world " * 50] * 200}), t / "good.parquet")
    data = bytearray((t / "good.parquet").read_bytes())
    (t / "bad_footer.parquet").write_bytes(bytes(data[:-12]) + b"\0" * 12)
    data[200:1200] = b"\xab" * 1000
    (t / "bad_pages.parquet").write_bytes(bytes(data))
    (t / "latin1.json").write_bytes(b'{"caf\xe9": 1}')
    (t / "hf").mkdir()
    (t / "hf" / "config.json").write_text("{}")
    (t / "hf" / "model.safetensors").write_text("")
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


# (name, argv, folder that must not change); T stands for the fixtures' folder.
PROBES = [
    ("another run's history, checkpointing off", [*TRAIN, "--job.dump_folder", "T/history",
                                                  "--checkpoint.enable", "false"], "T/history"),
    ("dump folder ''", [*TRAIN, "--job.dump_folder", ""], "T/cwd"),
    ("dump folder .", [*TRAIN, "--job.dump_folder", "."], "T/cwd"),
    ("a resume with a bad data state", [*RESUME, "--job.dump_folder", "T/bad_data_state"],
     "T/bad_data_state"),
    ("a shared absolute checkpoint.folder", [*TRAIN, "--job.dump_folder", "T/second",
                                             "--checkpoint.enable", "true",
                                             "--checkpoint.folder", "T/shared"], "T/shared"),
    ("parquet with a bad footer", [*TRAIN, "--job.dump_folder", "T/o1", "--training.dataset",
                                   "parquet", "--training.dataset_path", "T/bad_footer.parquet"],
     None),
    ("parquet with bad data pages", [*TRAIN, "--job.dump_folder", "T/o2", "--training.dataset",
                                     "parquet", "--training.dataset_path", "T/bad_pages.parquet"],
     None),
    ("a tokenizer that is not UTF-8", [*TRAIN, "--job.dump_folder", "T/o3",
                                       "--model.tokenizer_path", "T/latin1.json"], None),
    ("a dataset file that cannot be read", [*TRAIN, "--job.dump_folder", "T/o4",
                                            "--training.dataset", "jsonl",
                                            "--training.dataset_path", "/proc/self/mem"], None),
    ("hf_disk text column of another type", [*TRAIN, "--job.dump_folder", "T/o5",
                                             "--training.dataset", "hf_disk",
                                             "--training.dataset_path", "T/hf_int"], None),
    ("hf_disk with a corrupt state.json", [*TRAIN, "--job.dump_folder", "T/o6",
                                           "--training.dataset", "hf_disk",
                                           "--training.dataset_path", "T/hf_state"], None),
    ("a TensorBoard folder that is a file", [*TRAIN, "--job.dump_folder", "T/tb_run",
                                             "--metrics.enable_tensorboard", "true"], "T/tb_run"),
    ("inspect --json naming a folder", ["inspect", "--config", CFG, "--json", "T/folder"], None),
    ("compile --json naming a folder", ["compile", "--config", CFG, "--topology", "v5e-4",
                                        "--json", "T/folder"], None),
    ("convert into a path under a file", [*CONVERT, "T/model", "T/file/out"], None),
    ("convert of a damaged orbax model", [*CONVERT, "T/damaged_model", "T/out"],
     "T/damaged_model"),
    ("convert --max-shard-size 0", [*CONVERT, "T/model", "T/out", "--max-shard-size", "0"],
     None),
    ("generate with a file as --checkpoint", [*GENERATE, "T/file", "--prompt", "x"], None),
    ("generate beyond the model's positions", [*GENERATE, "T/model", "--prompt", "x",
                                               "--max-new-tokens", "70"], None),
    ("generate with a huge --seed", [*GENERATE, "T/model", "--prompt", "x", "--seed",
                                     str(2**70)], None),
    ("generate with a prompt that is not UTF-8", [*GENERATE, "T/model", "--prompt", "caf\udce9"],
     None),
    ("generate --temperature nan", [*GENERATE, "T/model", "--prompt", "x", "--temperature",
                                    "nan"], None),
    ("a resume from a truncated checkpoint", [*RESUME, "--job.dump_folder", "T/truncated"],
     "T/truncated"),
    ("[moe] keys on a dense model", [*TRAIN, "--job.dump_folder", "T/o7",
                                     "--moe.load_balance_coeff", "0.01"], None),
    ("parity --seq-len beyond the positions", ["parity", "--config", CFG, "--seq-len", "5000"],
     None),
    ("a coordinator port above 65535", [*TRAIN, "--job.dump_folder", "T/o8",
                                        "--distributed.num_processes", "2",
                                        "--distributed.process_id", "0",
                                        "--distributed.coordinator_address", "localhost:70000"],
     None),
    ("/dev/null as a dataset path", [*TRAIN, "--job.dump_folder", "T/o9", "--training.dataset",
                                     "jsonl", "--training.dataset_path", "/dev/null"], None),
    ("a HF directory as initial_load_path", [*TRAIN, "--job.dump_folder", "T/o10",
                                             "--checkpoint.initial_load_path", "T/hf"], None),
    ("a last_save_in_hf folder that exists", [*TRAIN, "--job.dump_folder", "T/export",
                                              "--checkpoint.enable", "true",
                                              "--checkpoint.last_save_in_hf", "true"],
     "T/export"),
]


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else
            hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.name != "titan-jax.log"}


def _probe(t: Path, name: str, argv: list[str], watch: str | None) -> bool:
    argv = [a.replace("T/", f"{t}/") for a in argv]
    folder = Path(watch.replace("T/", f"{t}/")) if watch else None
    holder = None
    if "shared" in name:  # another run holds the checkpoint folder's lock
        (t / "shared").mkdir(exist_ok=True)
        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl, os, socket, sys, time\n"
             f"f = open({str(t / 'shared' / '.titan-jax.lock')!r}, 'w')\n"
             "fcntl.flock(f, fcntl.LOCK_EX)\n"
             "f.write(f'{socket.gethostname()} pid {os.getpid()}'); f.flush()\n"
             "print('held', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
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
    ok = (out.returncode == 2 and len(lines) == 1 and lines[0].startswith("titan-jax: error: ")
          and not changed)
    print(f"{'ok ' if ok else 'BAD'} {name}: exit {out.returncode}, "
          f"{time.monotonic() - start:.0f} s{', FILES CHANGED' if changed else ''}")
    for line in lines if not ok else lines[:1]:
        print(f"    {line[:300]}")
    return ok


def main(names: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="titan-jax-probes-") as tmp:
        t = Path(tmp)
        (t / "cwd").mkdir()
        _fixtures(t)
        results = [_probe(t, name, argv, watch) for name, argv, watch in PROBES
                   if not names or any(n in name for n in names)]
    print(f"{sum(results)} of {len(results)} probes ok")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
