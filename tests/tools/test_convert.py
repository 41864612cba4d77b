"""`titan-jax convert` never overwrites what a user owns: not a non-empty destination (unless
--overwrite), never the source, and a crash part way leaves the destination as it was."""

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from titan_jax.cli import main
from titan_jax.models import safetensors_io
from titan_jax.models.qwen3 import Qwen3Args, build_model_def
from titan_jax.models.qwen3.hf import save_hf

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

ARGS = Qwen3Args(
    dim=16,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=8,
    hidden_dim=32,
    vocab_size=64,
    max_seq_len=32,
)
ROOT = Path(__file__).resolve().parents[2]


def digests(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


def hf_dir(path, seed=0):
    save_hf(path, build_model_def(ARGS).init(jax.random.key(seed)), ARGS)
    return path


def convert(*argv):
    return main(["convert", "--from", "hf", "--to", "hf", *map(str, argv)])


def test_a_non_empty_destination_is_refused_unless_overwrite(tmp_path, capsys):
    src, dst = hf_dir(tmp_path / "src", seed=0), hf_dir(tmp_path / "dst", seed=1)
    before = digests(dst)
    assert convert(src, dst) == 2
    err = capsys.readouterr().err
    assert f"destination {dst} exists and is not empty" in err and "--overwrite" in err
    assert err.count("\n") == 1 and digests(dst) == before
    assert convert(src, dst, "--overwrite") == 0
    assert digests(dst) == digests(src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temporaries left


def test_exported_files_have_normal_modes(tmp_path):
    umask = os.umask(0o022)
    try:
        folder = hf_dir(tmp_path / "hf")
    finally:
        os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {"0o644"}


@pytest.mark.parametrize("where", ["same", "inside", "holds"])
def test_the_source_is_never_the_destination(tmp_path, capsys, where):
    src = hf_dir(tmp_path / "src")
    dst = {"same": src, "inside": src / "out", "holds": tmp_path}[where]
    before = digests(tmp_path)
    assert convert(src, dst, "--dtype", "bfloat16", "--overwrite") == 2
    assert "lies inside the source" in capsys.readouterr().err
    assert digests(tmp_path) == before


def test_a_failed_write_leaves_the_destination_as_it_was(tmp_path, monkeypatch, capsys):
    src, dst = hf_dir(tmp_path / "src", seed=0), hf_dir(tmp_path / "dst", seed=1)
    before = digests(dst)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_io, "save_file", disk_full)
    assert convert(src, dst, "--overwrite") == 2  # the machine's refusal: one line, no traceback
    assert capsys.readouterr().err == (
        f"titan-jax: error: No space left on device: writing "
        f"{dst} failed; {dst} is as it was before\n"
    )
    assert digests(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


@pytest.mark.slow
def test_kill_9_mid_write_leaves_the_destination_as_it_was(tmp_path):
    src, dst = hf_dir(tmp_path / "src", seed=0), hf_dir(tmp_path / "dst", seed=1)
    before = digests(dst)
    script = (
        "import os, signal, sys\n"
        "from titan_jax import cli\n"
        "from titan_jax.models import safetensors_io as hf\n"
        "real = hf.save_file\n"
        "def half(data, path, **kw):\n"
        "    real(data, path, **kw)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "hf.save_file = half\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "convert",
            "--from",
            "hf",
            "--to",
            "hf",
            str(src),
            str(dst),
            "--overwrite",
        ],
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == -signal.SIGKILL
    assert digests(dst) == before  # the half-written copy is a hidden sibling
    assert convert(src, dst, "--overwrite") == 0  # which the next write clears
    assert digests(dst) == digests(src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]
