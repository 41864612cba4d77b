"""Every hand-written derivative in titan_jax (a function made a `jax.custom_vjp` or
`jax.custom_jvp`) says, in the comment just above it, why JAX's own derivative is not used and
which test fails without it (one sentence, wrapped at the line length; a long test id may break
after its `::`):

    # Hand-written VJP: <why>. Without it:
    # tests/<file>.py::<test>

The named test must exist (a `def test_...` in that file, and the values of a parametrized id
as strings there), so a renamed or deleted test shows up here. Read from the source by AST, as
tests/test_layering.py reads imports.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import titan_jax

PACKAGE = Path(titan_jax.__file__).parent
REPO = PACKAGE.parent
JUSTIFICATION = re.compile(
    r"^Hand-written VJP: (?P<why>.+)\. Without it: "
    r"(?P<file>tests/\S+\.py):: ?(?P<test>test_\w+)(?P<params>\[[^\]]+\])?$"
)
CUSTOM = {"custom_vjp", "custom_jvp"}


def _is_custom(node: ast.expr) -> bool:
    """`jax.custom_vjp`, `custom_vjp`, or `functools.partial(jax.custom_vjp, ...)`."""
    if isinstance(node, ast.Call):
        return _is_custom(node.func) or any(_is_custom(a) for a in node.args[:1])
    if isinstance(node, ast.Attribute):
        return node.attr in CUSTOM
    return isinstance(node, ast.Name) and node.id in CUSTOM


def custom_derivatives() -> list[tuple[Path, int, str]]:
    """(file, line of the first decorator, function name) of every custom derivative."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(map(_is_custom, node.decorator_list)):
                found.append((path, node.decorator_list[0].lineno, node.name))
    return found


def _comment_above(path: Path, line: int) -> str:
    """The comment lines right above `line` (1-based), as one line of text."""
    lines = path.read_text().splitlines()[: line - 1]
    block: list[str] = []
    while lines and lines[-1].strip().startswith("#"):
        block.insert(0, lines.pop().strip().lstrip("#").strip())
    return " ".join(block)


def _tests_in(path: Path) -> set[str]:
    return {
        n.name
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
    }


def _strings_in(path: Path) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _joins(test_id: str, values: set[str]) -> bool:
    """Whether `test_id` is some of `values` joined by "-" (a value may hold "-" itself)."""
    if test_id in values:
        return True
    return any(
        test_id.startswith(v + "-") and _joins(test_id[len(v) + 1 :], values) for v in values if v
    )


def test_each_custom_derivative_names_why_and_the_test_that_fails_without_it():
    found = custom_derivatives()
    # As many as the sources register rules for: a decorator this test misses would hide one.
    rules = sum(
        len(re.findall(r"\.def(?:vjp|jvp)\(", p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))
    )
    assert len(found) == rules > 0, (len(found), rules)
    problems = []
    for path, line, name in found:
        where = f"{path.relative_to(REPO)}:{line} {name}"
        match = JUSTIFICATION.match(_comment_above(path, line))
        if match is None:
            problems.append(f"{where}: no '# Hand-written VJP: <why>. Without it: <test>' above")
            continue
        test_file = REPO / match["file"]
        if not test_file.is_file() or match["test"] not in _tests_in(test_file):
            problems.append(f"{where}: {match['file']}::{match['test']} does not exist")
        elif (params := match["params"]) and not _joins(params[1:-1], _strings_in(test_file)):
            # a parametrized id: its values, joined by "-", are strings in the test file
            problems.append(f"{where}: {match['file']} has no parameters {params}")
    assert not problems, "\n".join(problems)


def test_the_check_can_fail():
    """The pattern refuses a justification without a test, and one naming a missing test."""
    assert JUSTIFICATION.match("Hand-written VJP: saves memory.") is None
    match = JUSTIFICATION.match(
        "Hand-written VJP: fp32 sums. Without it: tests/train/test_loss.py::test_nothing_like_it"
    )
    assert match is not None
    assert match["test"] not in _tests_in(REPO / match["file"])
    assert _joins("a-b-c-1", {"a-b", "c", "1"}) and not _joins("a-b-d", {"a-b", "c"})
