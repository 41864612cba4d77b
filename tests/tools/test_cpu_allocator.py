"""Tests for titan_jax/tools/cpu_allocator.py: the launcher preloads the allocator where one is
found on a CPU host, and is a no-op saying so elsewhere."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_jax.tools import cpu_allocator

ROOT = Path(__file__).resolve().parents[2]
CPU = {"JAX_PLATFORMS": "cpu", "PATH": os.environ.get("PATH", "")}


def test_the_child_process_has_the_allocator_mapped():
    library = cpu_allocator.find_allocator()
    if library is None:
        pytest.skip(f"no allocator installed: {cpu_allocator.HOW_TO_ADD}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop(cpu_allocator.ENV, None)
    # The child (cat) reads its own memory map: the library is mapped into it.
    run = subprocess.run(
        [sys.executable, "-m", "titan_jax.tools.cpu_allocator", "cat", "/proc/self/maps"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(library.resolve()) in run.stdout
    assert f"preloading {library}" in run.stderr


def test_no_preload_without_a_library_off_cpu_or_when_turned_off(monkeypatch):
    monkeypatch.setattr(cpu_allocator, "find_allocator", lambda: None)
    env, message = cpu_allocator.preload_env(CPU)
    assert env == CPU and cpu_allocator.HOW_TO_ADD in message
    for setting in (
        {"JAX_PLATFORMS": "tpu"},
        {"JAX_PLATFORMS": "cuda,cpu"},
        {cpu_allocator.ENV: "none"},
    ):
        monkeypatch.setattr(cpu_allocator, "find_allocator", lambda: Path("/lib/x.so"))
        env = {**CPU, **setting}
        assert cpu_allocator.preload_env(env)[0] == env


def test_an_explicit_library_is_put_first_once(tmp_path):
    library = tmp_path / "libfast.so"
    library.touch()
    env = {**CPU, cpu_allocator.ENV: str(library), "LD_PRELOAD": "/other.so"}
    once, _ = cpu_allocator.preload_env(env)
    assert once["LD_PRELOAD"] == f"{library} /other.so"
    assert cpu_allocator.preload_env(once)[0] == once
    missing = {**CPU, cpu_allocator.ENV: str(tmp_path / "absent.so")}
    env, message = cpu_allocator.preload_env(missing)
    assert env == missing and "no such file" in message


def test_mimalloc_gets_its_huge_pages_off_unless_set(tmp_path):
    library = tmp_path / "libmimalloc.so.3"
    library.touch()
    env, _ = cpu_allocator.preload_env({**CPU, cpu_allocator.ENV: str(library)})
    assert env["MIMALLOC_ALLOW_THP"] == "0"
    mine = {**CPU, cpu_allocator.ENV: str(library), "MIMALLOC_ALLOW_THP": "1"}
    assert cpu_allocator.preload_env(mine)[0]["MIMALLOC_ALLOW_THP"] == "1"


def test_make_train_and_bench_run_under_the_launcher():
    makefile = (ROOT / "Makefile").read_text()
    assert "CPU_MALLOC := $(BIN)/python -m titan_jax.tools.cpu_allocator" in makefile
    for target in ("train", "bench", "bench-update"):
        recipe = makefile.split(f"\n{target}:\n", 1)[1].split("\n\n", 1)[0]
        assert recipe.strip().startswith("$(CPU_MALLOC) "), target


def test_the_bench_names_the_mapped_allocator(tmp_path):
    maps = tmp_path / "maps"
    libc = "7f00-7f01 r-xp 00000000 fe:00 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    maps.write_text(libc + "7f02-7f03 r-xp 00000000 fe:00 2 /usr/lib/libtcmalloc_minimal.so.4\n")
    assert cpu_allocator.preloaded_allocator(str(maps)) == "/usr/lib/libtcmalloc_minimal.so.4"
    maps.write_text(libc + "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n")
    assert cpu_allocator.preloaded_allocator(str(maps)) is None
