"""The README and docs/*.md work verbatim: every `titan-jax` command in their bash blocks
parses (config overrides included), the cheap ones run, their `make` targets, paths and links
exist.

A command whose trailing comment says it needs the network, a TPU slice, a downloaded
checkpoint or a finished `make train` is parsed but not run.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from titan_jax.cli import _parse
from titan_jax.parallel.mesh import xla_flags_with_cpu_devices

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS = {page: page.read_text() for page in PAGES}
README = TEXTS[ROOT / "README.md"]
CLI = ".venv/bin/titan-jax"


def bash_commands() -> list[str]:
    """Every command line of the pages' ```bash blocks, continuation lines joined."""
    commands = []
    blocks = [b for text in TEXTS.values() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]
    for block in blocks:
        text = block.replace("\\\n", " ")
        commands += [
            line.strip()
            for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
    return commands


def argv(command: str) -> list[str]:
    return shlex.split(command, comments=True)


TITAN = [c for c in bash_commands() if c.startswith(CLI)]
CHEAP = [c for c in TITAN if "--print-config" in c]


def test_commands_are_found_and_use_the_venv():
    assert len(TITAN) >= 10
    assert not [c for c in bash_commands() if c.startswith("titan-jax")]  # not on PATH
    assert CHEAP


@pytest.mark.parametrize("command", TITAN)
def test_titan_jax_command_parses(command):
    args, config = _parse(argv(command)[1:])
    assert args.command in (
        "train",
        "inspect",
        "compile",
        "parity",
        "convert",
        "generate",
        "prepare-data",
        "goodput",
    )
    if args.command not in ("convert", "goodput"):  # these take no recipe
        assert config is not None  # every override named a real key with a valid value
    for word in argv(command):
        if word.startswith("configs/"):
            assert (ROOT / word).is_file(), word


@pytest.mark.parametrize("command", [c for c in bash_commands() if c.startswith("make ")])
def test_make_targets_exist(command):
    makefile = (ROOT / "Makefile").read_text()
    for target in argv(command)[1:]:
        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), target


@pytest.mark.slow
@pytest.mark.parametrize("command", CHEAP)
def test_cheap_commands_run(command):
    out = subprocess.run(
        [sys.executable, "-m", "titan_jax.cli", *argv(command)[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "[training]" in out.stdout


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_dangling_references(page):
    text = TEXTS[page]
    assert "DESIGN.md" not in text
    for path in re.findall(
        r"`((?:configs|notebooks|benchmarks|scripts|titan_jax|tests|docs)/"
        r"[^`* ]+)`",
        text,
    ):
        assert (ROOT / path).exists() or (ROOT / path.split(":")[0]).exists(), path
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):  # relative markdown links
        assert (page.parent / link).exists(), link


def test_readme_is_short_and_links_every_doc():
    assert len(README.splitlines()) <= 200
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in README, page.name


@pytest.mark.slow
def test_profiling_example_runs_and_writes_a_trace(tmp_path):
    (command,) = [c for c in TITAN if "--profiling.enable_profiling true" in c]
    # On the host's one CPU device, as a user runs it (not the tests' 8 simulated ones).
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_jax.cli",
            *argv(command)[1:],
            "--job.dump_folder",
            str(tmp_path),
        ],  # the last value wins
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "XLA_FLAGS": xla_flags_with_cpu_devices(os.environ.get("XLA_FLAGS", ""), None),
        },
    )
    assert out.returncode == 0, out.stderr
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert "validation at step 4" in out.stdout  # the recipe validates at its last step
