"""Tests run on 8 simulated CPU devices (set before JAX starts its backend), with every cache
(XLA's compiled steps, the measured CPU peak) in a temporary folder, not the user's ~/.cache."""

import atexit
import ctypes
import gc
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Once JAX's thread pool has run, torch's spinning OpenMP workers slow it ~20x on 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The two test workers (pytest-xdist) both load libtpu for ahead-of-time TPU compiles; without
# this the second one fails on libtpu's multi-process lockfile. No TPU is ever opened here.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
from titan_jax.jax_platform import add_libtpu_flags, default_libtpu_flags  # noqa: E402
from titan_jax.parallel.mesh import xla_flags_with_cpu_devices  # noqa: E402

# TPU programs compile with the libtpu flags `train` and `compile` set, so the AOT tests check
# the schedules and memory that ship.
default_libtpu_flags()
# Plus one the tests alone add: the SparseCore compiler leaves its loops rolled. The TensorCore
# program and its memory are the same either way; only the SparseCore offloads' own code
# differs (30B-A3B on v5p-16 at 2 layers: the MoE dispatch's gather 220,800 -> 20,480 bytes of
# SparseCore program), and unrolling it was ~45% of an MoE recipe's compile (91 -> 50 CPU
# seconds). `make plans` and `titan-jax compile` compile as shipped, and so does
# test_jax_platform's check of the shipped flags (its process drops this variable).
add_libtpu_flags(("--xla_sc_disable_mlo_loop_unroll=true",))

os.environ["XLA_FLAGS"] = xla_flags_with_cpu_devices(os.environ.get("XLA_FLAGS", ""), 8)
# XLA:CPU's generated code at LLVM's O1 (its default is higher): the suite's CPU programs compile
# ~15% faster and ran no slower here (the matmuls are library calls LLVM does not touch): the
# fp8/int8 learning test 124 -> 118 CPU seconds, the MoE recipe's CLI run 57 -> 51. TPU programs
# are libtpu's and the same either way. The `unoptimized_cpu_code` modules go lower still.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=1"

# One cache folder a session: the process that starts first (pytest-xdist's controller, or
# pytest alone) makes it; its workers and every CLI subprocess inherit it, so a step one test
# compiled is loaded, not compiled again, by the next test that builds the same program.
_CACHE = os.environ.get("TITAN_JAX_TEST_CACHE", "")
if not _CACHE:
    _CACHE = os.environ["TITAN_JAX_TEST_CACHE"] = tempfile.mkdtemp(prefix="titan_jax_test_cache_")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = _CACHE
os.environ["TITAN_JAX_COMPILATION_CACHE"] = os.path.join(_CACHE, "titan_jax", "xla")
# Python's bytecode too, written once a session under the cache folder (never beside the
# sources) and read by every later process: each `titan-jax` subprocess a test starts otherwise
# compiles jax, flax, orbax and ours from source again (~2 s of its start) where the
# environment says PYTHONDONTWRITEBYTECODE, as this machine's does, and uv installs no .pyc.
os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = os.path.join(_CACHE, "pycache")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", os.environ["TITAN_JAX_COMPILATION_CACHE"])


@pytest.fixture(scope="module")
def module_tmp_path(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A folder shared by a module's tests, removed after them (tmp_path_factory's folders
    live to the end of the session, and a module's runs and checkpoints can be gigabytes)."""
    path = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _least_compile_effort() -> Iterator[None]:
    """Programs compiled at XLA's lowest execution-time effort (O0), for the tests that check a
    TPU program compiles for its slice and fits its chips, or which kernels, dtypes and
    collectives it holds; not how fast it runs, its schedule, or exact byte counts (O0 keeps
    more host temporaries: the remat-mode test stays at the default). libtpu's
    scheduling passes are most of a recipe's compile (the 8B SFT recipe for v6e-8: 51 s at the
    default effort, 13 s at O0). Its memory check is the stricter for it: O0 left more bytes
    live in the recipe measured (5.39 GiB a chip, 4.85 at the default). `make plans` and
    `titan-jax compile` compile at the default."""
    previous = jax.config.jax_optimization_level
    jax.config.update("jax_optimization_level", "O0")
    yield
    jax.config.update("jax_optimization_level", previous)


least_compile_effort = pytest.fixture(_least_compile_effort, name="least_compile_effort")
# For a module-scoped fixture that compiles (a module of AOT checks sharing one program).
module_least_compile_effort = pytest.fixture(
    _least_compile_effort, scope="module", name="module_least_compile_effort"
)


def _unoptimized_cpu_code(wanted: bool) -> Iterator[None]:
    """XLA's backend optimisations off (`jax_disable_most_optimizations`: LLVM at O0, no
    expensive passes) in this process and the `titan-jax` processes a test starts, for the
    modules marked `unoptimized_cpu_code`: their tests compile many small CPU programs and run
    each a few steps, and LLVM's optimisation was most of that (test_lora_training.py: 238 ->
    136 CPU seconds). Modules whose steps run long (40-step numerics, step timings) stay
    optimised: there the slower code costs more than the compile saves."""
    previous = jax.config.values["jax_disable_most_optimizations"]
    previous_env = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
    jax.config.update("jax_disable_most_optimizations", wanted)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1" if wanted else "0"
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
    if previous_env is None:
        os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    else:
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = previous_env


@pytest.fixture(autouse=True, scope="module")
def _module_cpu_code(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a marked module's own fixtures (its reference runs compile before any test)."""
    yield from _unoptimized_cpu_code(
        request.node.get_closest_marker("unoptimized_cpu_code") is not None
    )


@pytest.fixture(autouse=True)
def _test_cpu_code(request: pytest.FixtureRequest) -> Iterator[None]:
    """A marked module's tests, except its TPU checks (`least_compile_effort`): those compile
    the TPU program with the backend's optimisations as shipped."""
    marked = request.node.get_closest_marker("unoptimized_cpu_code") is not None
    yield from _unoptimized_cpu_code(marked and "least_compile_effort" not in request.fixturenames)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> Iterator[None]:
    """A module's compiled programs are dropped after it: a test worker runs hundreds of
    modules, and JAX keeps every executable it compiled until told otherwise (a worker of the
    whole suite grew past half this machine's memory and was killed). A later module that
    builds the same program loads it from the session's compilation cache."""
    yield
    jax.clear_caches()
    gc.collect()
    _return_free_memory_to_the_os()


def _return_free_memory_to_the_os() -> None:
    """tcmalloc (preloaded by `make test`: titan_jax/tools/cpu_allocator.py) keeps what a module
    freed for reuse; handed back, it stops counting against the machine's memory while the
    other worker and the training subprocesses need it (one worker held 12 GB resident)."""
    release = getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()


# The test files that run longest, or hold the longest single tests (minutes of libtpu compile
# or subprocess training; `make test`'s --durations). Started first (`--dist loadfile
# --no-loadscope-reorder` hands out files in collection order; xdist's default reorder puts the
# files with the most tests first), the workers run them side by side and finish on the short
# files, rather than one worker ending on a long one while the cores idle.
LONGEST_FILES = (
    "tests/parallel/test_moe_recipe_235b_aot.py",
    "tests/parallel/test_pretraining_recipes_aot.py",
    "tests/parallel/test_posttraining_recipes_aot.py",
    "tests/parallel/test_moe_recipes_aot.py",
    "tests/parallel/test_tpu_aot.py",
    "tests/parallel/test_pipeline.py",
    "tests/train/test_dpo.py",
    "tests/train/test_resume.py",
    "tests/train/test_quantized_training.py",
    "tests/train/test_lora_training.py",
    "tests/parallel/test_moe_training.py",
    "tests/parallel/test_multihost.py",
    "tests/parallel/test_lost_process.py",
    "tests/parallel/test_multi_tier.py",
    "tests/parallel/test_qlora_aot.py",
    "tests/parallel/test_context_parallel.py",
    "notebooks/05_lora_with_peft.ipynb",  # last in collection order: a run ended on them
    "notebooks/04_tpu_planning.ipynb",
)


# Tests measured at 8 s or more in a full run, marked slow here rather than one decorator each,
# so that `make test-fast` stays under 8 minutes (scripts/slow_tests_from_durations.py writes
# the list from a run's --durations=0; `make test` runs them all the same).
SLOW_BY_MEASUREMENT = Path(__file__).with_name("slow_by_measurement.txt")


def _slow_by_measurement() -> set[str]:
    if os.environ.get("TITAN_JAX_IGNORE_SLOW_LIST"):
        return set()
    lines = SLOW_BY_MEASUREMENT.read_text().splitlines()
    return {line.split(None, 1)[1] for line in lines if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = _slow_by_measurement()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    missing = [f for f in LONGEST_FILES if not (config.rootpath / f).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FILES names missing files: {missing}")

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.partition("::")[0]
        return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
