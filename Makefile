# titan-jax: `make install` then `make train` / `make test`.
# Python >= 3.12 (jax 0.11+ dropped 3.11): pyenv's versions folder first (its python3.12 shim
# exists even where 3.12 is not selected, and then fails), else python3.12 on PATH. PY= chooses.
PY ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),$(shell command -v python3.12))
VENV := .venv
BIN := $(VENV)/bin
# libtpu (the tpu extra) probes for a TPU at every `import jax`; on machines without TPU or
# GPU devices say "cpu" up front. On a TPU VM or GPU box JAX picks the accelerator itself.
export JAX_PLATFORMS ?= $(if $(wildcard /dev/accel* /dev/vfio/* /dev/nvidia0),,cpu)

.PHONY: install train test test-fast lint format docs bench bench-update bench-deps plans tokenizer clean

CHECK_PY = @test -n "$(PY)" && "$(PY)" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	  || { echo "titan-jax needs Python >= 3.12; PY='$(PY)' is not one (looked in pyenv's versions/3.12* and for python3.12 on PATH); set PY=/path/to/python3.12"; exit 2; }

# A .venv left by an older interpreter is rebuilt, not upgraded in place. uv installs into it:
# the same pins as pip, several times faster (docs/notes/2026-12-05-install-and-test-times.md).
$(BIN)/python:
	$(CHECK_PY)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
UV_PIP = $(BIN)/uv pip install --python $(BIN)/python

# torch 2.13.0 for the parity references: under Python 3.12 the registry's build is the CUDA
# one (with its CUDA libraries; it runs on CPU). Installed first and pinned, so
# transformers and torchtitan resolve against it.
# tpu: libtpu (~700 MB) for ahead-of-time TPU compiles on this CPU (tests/parallel/test_tpu_aot.py);
# with JAX_PLATFORMS=cpu (exported above, and set by the tests) CPU runs are unaffected.
# torchtitan (a parity reference): its declared deps (torchdata, wandb, tensorboard,
# datasets<4.8) are not needed to import it and clash with ours, hence --no-deps; the few it
# does import are in the parity extra.
install:
	@test ! -x $(BIN)/python || $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
	  || { echo "make install: $(VENV) is an older Python's; rebuilding it"; rm -rf $(VENV); }
	@$(MAKE) --no-print-directory $(BIN)/python
	$(BIN)/pip install uv==0.13.9
	$(UV_PIP) torch==2.13.0
	$(UV_PIP) -e '.[test,parity,tpu,cpu]'
	$(UV_PIP) --no-deps torchtitan==0.3.0

# CPU_MALLOC: on CPU hosts, runs the command with tcmalloc (apt: libtcmalloc-minimal4) or else
# mimalloc (the cpu extra) preloaded: XLA:CPU's per-step temporaries then stop faulting in fresh
# pages every step (docs/notes/2026-12-02-cpu-page-faults.md). A no-op, with one line saying so,
# where neither is installed or on TPU/GPU hosts.
CPU_MALLOC := $(BIN)/python -m titan_jax.tools.cpu_allocator

train:
	$(CPU_MALLOC) $(BIN)/titan-jax train --config configs/qwen3_debug.toml

# Three workers on two cores, one test file each at a time (module fixtures stay shared): with
# two, the cores sat idle 14% of the time while tests waited on their `titan-jax` subprocesses
# (startup, saves, peers). tcmalloc preloaded (libtpu's compiles spend time in glibc's malloc)
# and one compilation cache for the session (tests/conftest.py) shorten the run; XLA:CPU at
# -O0 was tried and not kept (docs/notes/2026-12-05-install-and-test-times.md).
test:
	$(CPU_MALLOC) $(BIN)/python -m pytest -q --durations=40 -n 3 --dist loadfile --no-loadscope-reorder tests --nbmake notebooks

test-fast:
	$(CPU_MALLOC) $(BIN)/python -m pytest -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" tests

# pyrefly: the package's types ([tool.pyrefly] in pyproject.toml); any finding fails.
lint:
	$(BIN)/ruff check titan_jax tests scripts benchmarks
	$(BIN)/ruff format --check titan_jax tests scripts benchmarks
	$(BIN)/pyrefly check --python-interpreter-path $(BIN)/python

format:
	$(BIN)/ruff format titan_jax tests scripts benchmarks

# docs/CONFIG.md from the field comments of titan_jax/config_schema.py.
docs:
	$(BIN)/python -m titan_jax.tools.config_reference
	$(BIN)/python -m titan_jax.tools.sharding_reference

# bench prints the table; bench-update also rewrites it in BENCHMARKS.md. The MaxText column
# runs only when .venv-maxtext exists (`make bench-deps`): MaxText 0.2.5 in a venv of its own
# (its dependency tree is large and pins what ours need not), on our jax and libtpu.
MAXTEXT_VENV := .venv-maxtext

bench-deps:
	$(CHECK_PY)
	$(PY) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/pip install --upgrade pip
	$(MAXTEXT_VENV)/bin/pip install -c benchmarks/maxtext-constraints.txt 'maxtext[tpu]==0.2.5'

bench:
	$(CPU_MALLOC) $(BIN)/python benchmarks/bench_step.py

bench-update:
	$(CPU_MALLOC) $(BIN)/python benchmarks/bench_step.py --write BENCHMARKS.md

# The pod recipes compiled ahead of time for their TPU slices (libtpu, no TPU), into docs/TPU.md.
plans:
	ALLOW_MULTIPLE_LIBTPU_LOAD=1 $(BIN)/python benchmarks/tpu_plans.py --write docs/TPU.md
	$(BIN)/python benchmarks/pipeline_plans.py --write docs/PARALLELISM.md

tokenizer:
	$(BIN)/python scripts/build_tokenizer.py

clean:
	rm -rf outputs .pytest_cache
