"""The package's layers, lowest first: config (and errors) < data < models, parallel < train
< tools, planner, parity < cli. A module never imports a higher layer, and no import cycle exists.

Read from the source (every `import`/`from ... import` of titan_jax, at any depth), so a lazy
import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import titan_jax

ROOT = Path(titan_jax.__file__).parent
# Package (first component under titan_jax) -> layer rank.
LAYERS = {
    "errors": 0,
    "config_schema": 0,
    "config": 0,
    "atomic_dir": 0,
    "jax_platform": 0,
    "planner_hints": 0,
    "trees": 0,
    "yarn": 0,
    "cli_commands": 6,
    "planner": 5,
    "data": 1,
    "models": 2,
    "parallel": 3,
    "train": 4,
    "tools": 5,
    "parity": 5,
    "cli": 6,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        name = _module_name(path)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        modules = {m for m in found if m.startswith("titan_jax.")}
        graph[name] = {m for m in modules if _is_module(m)}
    return graph


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return -1  # the package itself
    return LAYERS[parts[1]]


def test_every_package_has_a_layer():
    packages = {
        p.name if p.is_dir() else p.stem
        for p in ROOT.iterdir()
        if (p.is_dir() and (p / "__init__.py").is_file())
        or (p.suffix == ".py" and p.stem != "__init__")
    }
    assert packages <= set(LAYERS), packages - set(LAYERS)


def test_no_module_imports_a_higher_layer():
    bad = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in _imports().items()
        for d in deps
        if _layer(d) > _layer(m)
    ]
    assert not bad, "\n".join(bad)


def test_models_and_parallel_are_independent_of_each_other_downwards():
    """parallel may use the model interface; models never know about parallel."""
    bad = [
        f"{m} imports {d}"
        for m, deps in _imports().items()
        for d in deps
        if m.startswith("titan_jax.models") and d.startswith("titan_jax.parallel")
    ]
    assert not bad, bad


def test_models_and_parallel_never_see_the_job_config():
    """The run's plan hands models/ and parallel/ the typed values they need (degrees, build
    options, args overrides); they never import the config loader or name `JobConfig`."""
    bad = [
        f"{m} imports {d}"
        for m, deps in _imports().items()
        for d in deps
        if m.startswith(("titan_jax.models", "titan_jax.parallel")) and d == "titan_jax.config"
    ]
    named = [
        str(path.relative_to(ROOT.parent))
        for package in ("models", "parallel")
        for path in (ROOT / package).rglob("*.py")
        if "JobConfig" in path.read_text()
    ]
    assert not bad and not named, bad + named


# TorchTitan's own Qwen3 is the parity reference for this family, so its adapter is Qwen3's.
FAMILY_SPECIFIC = {"titan_jax.parity.torchtitan_ref"}


def test_a_model_family_is_reached_only_through_the_registry():
    """Outside models/, code gets a family from `get_model_spec` / `spec_of_args`."""
    bad = [
        f"{m} imports {d}"
        for m, deps in _imports().items()
        for d in deps
        if d.startswith("titan_jax.models.qwen3")
        and not m.startswith("titan_jax.models")
        and m not in FAMILY_SPECIFIC
    ]
    assert not bad, bad


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            # A package importing its own submodules (or itself, `from pkg import sub`) is not a
            # cycle; a submodule importing its package is.
            if dep == node or dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)
