"""Real `titan-jax train` processes killed, signalled and resumed; bad input at the CLI.

Every resumed run's logged losses must equal the uninterrupted run's bit for bit (metrics.jsonl
floats are compared with ==), and bad input must fail with one line, exit code 2 and the
checkpoints left as they were.
"""

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from cli_args import QUIET_METRICS
from tiny_model import TINY

from titan_jax.cli import main
from titan_jax.models.qwen3 import build_model_def
from titan_jax.train.model_io import save_orbax

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
ARGS = [
    "--config",
    str(ROOT / "configs" / "qwen3_debug.toml"),
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    *QUIET_METRICS,
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The children share a persistent compilation cache: only the first one compiles."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


class Run:
    """One `titan-jax train` process on one CPU device, writing into `folder`."""

    def __init__(self, env, folder, *extra, dump_folder=None, args=ARGS):
        self.folder = folder
        self.metrics = folder / "metrics.jsonl"
        self.first_line = len(_lines(self.metrics))  # earlier runs' lines come before
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder.parent / f"{folder.name}-{time.monotonic_ns()}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "titan_jax.cli",
                    "train",
                    *args,
                    "--job.cpu_devices",
                    "1",
                    "--job.dump_folder",
                    dump_folder or str(folder),
                    *extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )

    def output(self):
        return self.log.read_text()

    def losses(self):
        """{step: loss} of the lines this run logged."""
        return {r["step"]: r["loss"] for r in _records(_lines(self.metrics)[self.first_line :])}

    def wait_for(self, condition, what, timeout=300):
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"exited before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.output()}"
            time.sleep(0.005)

    def signal(self, sig):
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def finish(self, timeout=300):
        code = self.proc.wait(timeout)
        assert code == 0, self.output()
        return self.output()


def _lines(path):
    return path.read_text().splitlines(keepends=True) if path.exists() else []


def _records(lines):
    out = []
    for line in lines:
        try:  # a line torn by kill -9 is skipped, as the logger does
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def finalized(ckpt):
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


def partial_saves(ckpt):
    return sorted(p.name for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name)


def snapshot(folder):
    """Every file but the run's log (where a refused run records why)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "titan-jax.log"
    }


@pytest.fixture(scope="module")
def reference(env, module_tmp_path):
    """An uninterrupted run, keeping its two newest checkpoints."""
    run = Run(env, module_tmp_path / "reference", "--checkpoint.keep_latest_k", "2")
    run.finish()
    return run


@pytest.mark.slow
def test_reference_run_keeps_k_checkpoints_and_ends_model_only(reference):
    ckpt = reference.folder / "checkpoint"
    assert finalized(ckpt) == [10, 12] and partial_saves(ckpt) == []
    assert not (ckpt / "12" / "data").exists() and (ckpt / "10" / "data").is_dir()
    assert sorted(reference.losses()) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_kill_at_any_point_resumes_bitwise_and_sigterm_saves(env, reference, tmp_path):
    # Resuming after SIGTERM is tested in-process (test_checkpoint.py), with a real signal.
    expected = reference.losses()
    folder, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoint"
    runs = []

    # 1. kill -9 while step 4's checkpoint is being written: the partial save is left behind.
    run = Run(env, folder)
    runs.append(run)
    run.wait_for(
        lambda: ckpt.is_dir() and any(ckpt.glob("4.orbax-checkpoint-tmp*")),
        "the save of step 4 to start",
    )
    run.signal(signal.SIGKILL)
    assert finalized(ckpt) == [2] and partial_saves(ckpt), os.listdir(ckpt)

    # 2. It is ignored: resume from step 2. kill -9 between checkpoints 4 and 6.
    run = Run(env, folder)
    runs.append(run)
    run.wait_for(lambda: 4 in finalized(ckpt) and 5 in run.losses(), "checkpoint 4 and step 5")
    run.signal(signal.SIGKILL)
    assert "resuming at step 3 from checkpoint" in run.output()
    assert finalized(ckpt)[-1] == 4

    # 3. Resume from step 4, then SIGTERM: the current step is saved and the exit code is 0.
    run = Run(env, folder)
    runs.append(run)
    run.wait_for(lambda: 7 in run.losses(), "step 7")
    last_logged = max(run.losses())
    run.signal(signal.SIGTERM)
    out = run.finish()
    assert "resuming at step 5 from checkpoint" in out and partial_saves(ckpt) == []
    saved = int(re.search(r"SIGTERM: stopped after step (\d+); saved checkpoint step \1", out)[1])
    assert last_logged < saved <= last_logged + 2 and finalized(ckpt)[-1] == saved

    for i, run in enumerate(runs, start=1):
        losses = run.losses()
        assert losses and losses == {s: expected[s] for s in losses}, f"run {i}"
    records = _records(_lines(folder / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, saved + 1))  # each step once
    assert {r["step"]: r["loss"] for r in records} == {s: expected[s] for s in range(1, saved + 1)}


@pytest.mark.slow
def test_a_second_ctrl_c_quits_at_once(env, tmp_path):
    """Inside a step (long ones here), not after it: the second SIGINT takes its default
    action rather than a KeyboardInterrupt that waits for the compiled call to return."""
    run = Run(env, tmp_path / "run", "--training.seq_len", "512")
    run.wait_for(lambda: 1 in run.losses(), "step 1")
    run.signal(signal.SIGINT)
    run.wait_for(lambda: "send it again to quit at once" in run.output(), "the first note")
    start = time.monotonic()
    run.signal(signal.SIGINT)
    code = run.proc.wait(60)
    assert code == -signal.SIGINT and time.monotonic() - start < 5, (code, run.output())


@pytest.mark.slow
def test_a_url_run_folder_killed_resumes_bitwise_on_another_machine(env, reference, tmp_path):
    """`--job.dump_folder file://...` goes the way of a gs:// bucket (train/run_folder.py):
    metrics and log through a local mirror copied out at saves, checkpoints written there by
    orbax, a lease instead of a lock. Killed on one "machine" (its own cache folder, where the
    mirror lives), the run resumes on another from what the URL holds."""
    expected = reference.losses()
    folder = tmp_path / "bucket" / "run 1"
    url, ckpt = "file://" + str(folder), folder / "checkpoint"
    machine = {**env, "XDG_CACHE_HOME": str(tmp_path / "machine-1")}
    run = Run(machine, folder, dump_folder=url)
    run.wait_for(
        lambda: ckpt.is_dir() and 4 in finalized(ckpt) and 4 in run.losses(),
        "checkpoint 4 and its metrics at the URL",
    )
    run.signal(signal.SIGKILL)
    assert (folder / ".titan-jax.lease").is_file()  # left by the kill

    machine = {**env, "XDG_CACHE_HOME": str(tmp_path / "machine-2")}
    out = Run(machine, folder, "--metrics.plot_loss", "true", dump_folder=url).finish()
    assert "resuming at step 5 from checkpoint" in out
    assert "taking over the lease of a run that is gone" in out
    records = _records(_lines(folder / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
    assert {r["step"]: r["loss"] for r in records} == expected
    assert finalized(ckpt)[-1] == STEPS and partial_saves(ckpt) == []
    assert (folder / "loss.png").is_file() and not (folder / ".titan-jax.lease").exists()
    assert not list((tmp_path / "machine-2").rglob("metrics.jsonl"))  # the mirror is gone


def killed_and_resumed(env, tmp_path, *extra, args=ARGS):
    """`args` + `extra` for 4 steps, a checkpoint every 2 (the last the whole state), run
    uninterrupted and run killed (SIGKILL) after checkpoint 2 and step 3, then resumed: asserts
    the two log the same losses and end with the same state, bit for bit. Returns that state
    and the resumed run.
    The first process compiles the step; the others load it from the shared compilation cache."""
    steps = ["--training.steps", "4", "--checkpoint.last_save_model_only", "false"]
    whole = Run(env, tmp_path / "whole", *steps, *extra, "--checkpoint.interval", "4", args=args)
    whole.finish()
    folder, ckpt = tmp_path / "split", tmp_path / "split" / "checkpoint"
    first = Run(env, folder, *steps, *extra, "--checkpoint.interval", "2", args=args)
    first.wait_for(
        lambda: ckpt.is_dir() and 2 in finalized(ckpt) and 3 in first.losses(),
        "checkpoint 2 and step 3",
    )
    first.signal(signal.SIGKILL)
    second = Run(env, folder, *steps, *extra, "--checkpoint.interval", "2", args=args)
    assert "resuming at step 3 from checkpoint" in second.finish()
    assert {**first.losses(), **second.losses()} == whole.losses()
    with ocp.PyTreeCheckpointer() as reader:
        final = [
            reader.restore(run.folder / "checkpoint" / "4" / "state") for run in (whole, second)
        ]
    jax.tree.map(np.testing.assert_array_equal, *final)
    return final[0], second


@pytest.mark.slow
def test_a_pipelined_run_killed_resumes_bitwise(env, tmp_path):
    """pp 2 x fsdp 4 on 8 CPU devices: the stages' layers, their optimizer state and the data
    stream's place come back from checkpoint 2 as the uninterrupted run had them."""
    pp2 = ["--job.cpu_devices", "8", "--parallelism.pipeline_parallel_degree", "2"]
    quick = ["--validation.enable", "false", "--metrics.peak_flops", "1e12"]  # no MFU peak run
    _, resumed = killed_and_resumed(env, tmp_path, *pp2, *quick)
    assert "mesh {'pp': 2, 'dp_replicate': 1, 'fsdp': 4," in resumed.output()


def damage(step_dir, how):
    """Damages checkpoint `step_dir` (its files may be hard links: they are replaced, not edited).

    "altered" rewrites the arrays in a valid format with one value changed, as bit rot the
    format's own checks miss (flipping file bytes lands in a zstd-compressed chunk or in a raw
    one depending on the write order: only the raw case reaches the checksums); "truncate" cuts
    the largest file in half."""
    if how == "altered":
        state = step_dir / "state"
        tree = ocp.PyTreeCheckpointer().restore(state)
        leaves, treedef = jax.tree.flatten(tree)
        first = np.array(leaves[0])
        first.flat[0] += 1
        altered = state.with_name("state.altered")
        ocp.PyTreeCheckpointer().save(altered, jax.tree.unflatten(treedef, [first, *leaves[1:]]))
        shutil.rmtree(state)
        altered.rename(state)
        return
    biggest = max(step_dir.rglob("*"), key=lambda p: p.stat().st_size)
    data = bytes(biggest.read_bytes())
    biggest.unlink()
    biggest.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "case,args,message",
    [
        ("altered", [], "checkpoint/10 is corrupt: "),
        ("truncate", [], "checkpoint/10 is unreadable (corrupt or truncated)"),
        (
            "flavour",
            ["--model.flavor", "0.6B"],
            "checkpoint/10 does not fit this model: "
            "params.layers.attention.k_norm.weight has shape (8, 128) in the "
            "checkpoint but (28, 128) "
            "in the model (it was saved with model.flavor=debugmodel)",
        ),
        ("config", ["--training.seed", "7"], "the config changed training.seed=7 (checkpoint: 42)"),
        (
            "load_step",
            ["--checkpoint.load_step", "3"],
            "checkpoint.load_step=3 is not a finalized checkpoint in",
        ),
        ("model_only", ["--training.steps", "20"], "checkpoint/12 holds only the model"),
    ],
)
def test_bad_checkpoints_fail_cleanly_at_the_cli(
    reference, tmp_path, capsys, monkeypatch, case, args, message
):
    # In-process on 2 of the 8 simulated devices: FSDP 2, another mesh than the saved one, with
    # the same global batch (2).
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:2])
    dump = tmp_path / "run"
    keep_final = case in ("load_step", "model_only")
    shutil.copytree(
        reference.folder / "checkpoint",
        dump / "checkpoint",
        copy_function=os.link,
        ignore=None if keep_final else shutil.ignore_patterns("12"),
    )
    if case in ("altered", "truncate"):
        damage(dump / "checkpoint" / "10", case)
    before = snapshot(dump)
    code = main(
        ["train", *ARGS, "--training.local_batch_size", "1", "--job.dump_folder", str(dump), *args]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith("titan-jax: error: ") and err.count("\n") == 1
    assert snapshot(dump) == before
    if case == "load_step":
        assert "available: 10, 12" in err
    gc.collect()  # orbax leaves a failed read's coroutines to the collector: here, filtered


@pytest.mark.slow
def test_a_damaged_orbax_read_prints_its_one_line_and_nothing_else(reference, env, tmp_path):
    """orbax closes a failed restore's event loop while TensorStore reads are in flight; their
    callbacks printed "Event loop is closed" tracebacks around the one-line error, during the
    run and at exit. A process that resumes from a truncated checkpoint, then converts an orbax
    model with a missing data file (the two orbax readers), prints its two errors only."""
    dump = tmp_path / "run"
    shutil.copytree(
        reference.folder / "checkpoint", dump / "checkpoint", ignore=shutil.ignore_patterns("12")
    )
    for f in (dump / "checkpoint" / "10" / "state" / "d").iterdir():
        f.write_bytes(f.read_bytes()[:10])
    model = tmp_path / "model"
    save_orbax(model, build_model_def(TINY).init(jax.random.key(0)), TINY)
    for f in (model / "params" / "d").iterdir():
        f.unlink()
    calls = [
        ["train", *ARGS, "--job.cpu_devices", "1", "--job.dump_folder", str(dump)],
        ["convert", "--from", "orbax", "--to", "hf", str(model), str(tmp_path / "hf")],
    ]
    script = f"from titan_jax.cli import main\nfor argv in {calls!r}:\n    main(argv)\n"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        timeout=300,
        capture_output=True,
        text=True,
    )
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr[-3000:]
    assert lines[0].startswith(
        f"titan-jax: error: checkpoint {dump / 'checkpoint' / '10'} is "
        "unreadable (corrupt or truncated): "
    )
    assert lines[1].startswith(f"titan-jax: error: orbax model {model} is unreadable")


@pytest.mark.parametrize("case", ["unwritable", "hf_not_qwen3"])
def test_bad_folders_fail_cleanly_at_the_cli(tmp_path, capsys, case):
    if case == "unwritable":
        (tmp_path / "file").write_text("")  # a path through a file (root ignores permissions)
        args, message = ["--job.dump_folder", str(tmp_path / "file" / "run")], "which is a file"
    else:
        (tmp_path / "llama").mkdir()
        (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (tmp_path / "llama" / "model.safetensors").write_bytes(b"")
        args = [
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--checkpoint.initial_load_path",
            str(tmp_path / "llama"),
            "--checkpoint.initial_load_in_hf",
            "true",
        ]
        message = "model_type='llama' is not a Qwen3 or Qwen3-MoE checkpoint"
    code = main(["train", *ARGS, *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
