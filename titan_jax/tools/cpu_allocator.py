"""Run a command with a faster malloc preloaded on CPU hosts: `python -m
titan_jax.tools.cpu_allocator CMD [ARGS...]` (what `make train` and `make bench` do).

Why (docs/notes/2026-12-02-cpu-page-faults.md): XLA:CPU allocates a step's temporaries as one
block per execution (1.76 GB at debugmodel 4 x 256) and frees it after. glibc serves a block
that large with a fresh mmap and unmaps it on free, so every step faults in ~400k kernel-zeroed
pages (~20% of the step's CPU time). tcmalloc and mimalloc keep the freed block for the next
step. Neither XLA nor JAX has an option for the host allocator, and LD_PRELOAD is read only when
a process starts: hence a launcher that execs the command with it set.

Which (measured in docs/notes/2026-12-02-cpu-page-faults.md): tcmalloc where the system has it
(Debian's libtcmalloc-minimal4; `.ci/run` installs it as root): no fault left, PyTorch in the
same process unchanged, but a second temporaries block stays resident (+1.5 GB at the debug
shape). Else mimalloc from the `cmeel-mimalloc` wheel (the `cpu` extra of `make install`, no
root needed) with its transparent huge pages off: as fast for titan-jax, but PyTorch's step
took +13% CPU under it (+50% with THP on). `TITAN_JAX_ALLOCATOR` overrides:
`none` (glibc), or a library's path. Hosts with a TPU or GPU device node, or JAX_PLATFORMS
naming anything but cpu, get no preload: their step's buffers live on the device. Where no
allocator is found the command runs unchanged, with one line saying so.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from titan_jax.jax_platform import has_accelerator_device

ENV = "TITAN_JAX_ALLOCATOR"
MIMALLOC_IN_WHEEL = "cmeel.prefix/lib/libmimalloc.so.3"
SYSTEM_TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)
HOW_TO_ADD = (
    "apt-get install libtcmalloc-minimal4, or pip install cmeel-mimalloc (the cpu "
    "extra of `make install`)"
)


def find_allocator() -> Path | None:
    """System tcmalloc, else mimalloc from the cmeel-mimalloc wheel, else None."""
    system = next((Path(p) for p in SYSTEM_TCMALLOC if Path(p).is_file()), None)
    return system or _mimalloc_from_wheel()


def _mimalloc_from_wheel() -> Path | None:
    try:
        located = importlib.metadata.distribution("cmeel-mimalloc").locate_file(MIMALLOC_IN_WHEEL)
        path = Path(str(located))  # a path-like protocol object; a Path for installed wheels
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def is_cpu_host(env: dict[str, str]) -> bool:
    """JAX will run on the host CPU: JAX_PLATFORMS is cpu, or unset without a device node."""
    platforms = env.get("JAX_PLATFORMS")
    if platforms:
        return platforms.split(",") == ["cpu"]
    return not has_accelerator_device()


def preload_env(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """(the environment to run the command in, a line saying which allocator it gets)."""
    choice = env.get(ENV, "")
    if choice == "none":
        return env, f"glibc malloc ({ENV}=none)"
    if not is_cpu_host(env):
        return env, "no allocator preload: not a CPU host (the step's buffers are on the device)"
    library = Path(choice) if choice else find_allocator()
    if library is None:
        return env, (
            f"no allocator preload found, glibc malloc (CPU steps ~15-20% slower: "
            f"BENCHMARKS.md): {HOW_TO_ADD}"
        )
    if not library.is_file():
        return env, f"{ENV}={choice}: no such file; glibc malloc"
    preloads = env.get("LD_PRELOAD", "").split()
    if str(library) not in preloads:
        env = {**env, "LD_PRELOAD": " ".join([str(library), *preloads])}
    if "mimalloc" in library.name:  # its huge-page faults cost PyTorch's step +50% CPU here
        env = {"MIMALLOC_ALLOW_THP": "0", **env}
    return env, f"preloading {library} (LD_PRELOAD)"


def preloaded_allocator(maps: str = "/proc/self/maps") -> str | None:
    """The path of a malloc library mapped into this process (mimalloc, tcmalloc, jemalloc),
    or None (glibc's)."""
    with open(maps) as lines:
        paths = {line.split()[-1] for line in lines if "/" in line}
    return next(
        (
            p
            for p in sorted(paths)
            if any(name in Path(p).name for name in ("mimalloc", "tcmalloc", "jemalloc"))
        ),
        None,
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m titan_jax.tools.cpu_allocator CMD [ARGS...]")
    env, message = preload_env(dict(os.environ))
    print(f"titan-jax: {message}", file=sys.stderr, flush=True)
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main()
