"""docs/CONFIG.md, generated from the field comments of `titan_jax/config_schema.py`.

The schema's comments are the one description of every key: this module reads them from the
source (the comment lines right above a field and the comment after it on its line, the class
docstring for a section) and writes one table per section. `make docs` rewrites the page;
`tests/test_config_reference.py` fails when it is stale or a field has no comment.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
from pathlib import Path

from titan_jax import config_schema

SCHEMA = Path(config_schema.__file__)
HEADER = """# Config reference

Generated from the field comments in `titan_jax/config_schema.py` by `make docs`; do not edit
by hand (`tests/test_config_reference.py` fails when this page is stale). Sections and keys
follow TorchTitan's TOML. Set a key in a recipe's `[section]` or on the command line as
`--section.key value` (booleans `true`/`false`, optional numbers `none`).
"""


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    default: str
    choices: tuple[str, ...]
    comment: str


def comments_of(source: str) -> dict[int, str]:
    """{line number: comment text} of every comment in `source`."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def _choices(annotation: ast.expr) -> tuple[str, ...]:
    """The values of a `Literal[...]` annotation, else ()."""
    if (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id == "Literal"
    ):
        elts = (
            annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        )
        return tuple(str(ast.literal_eval(e)) for e in elts)
    return ()


def _field_comment(node: ast.AnnAssign, comments: dict[int, str], lines: list[str]) -> str:
    above = []
    line = node.lineno - 1
    while line in comments and lines[line - 1].lstrip().startswith("#"):
        above.insert(0, comments[line])
        line -= 1
    after = [comments[node.lineno]] if node.lineno in comments else []
    return " ".join(above + after).replace("|", "\\|")


def schema_sections(source: str | None = None) -> dict[str, tuple[str, list[Field]]]:
    """{class name: (docstring, fields)} of every dataclass in the schema, in source order."""
    source = SCHEMA.read_text() if source is None else source
    comments, lines = comments_of(source), source.splitlines()
    sections = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or node.name == "JobConfig":
            continue
        fields = [
            Field(
                item.target.id,
                (ast.get_source_segment(source, item.value) or "") if item.value else "",
                _choices(item.annotation),
                _field_comment(item, comments, lines),
            )
            for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        ]
        if fields:
            sections[node.name] = (ast.get_docstring(node) or "", fields)
    return sections


def _default(text: str, value: object = None) -> str:
    """The default as the docs show it: the schema's literal, else `value` (the field's default
    at run time: one owned elsewhere, such as YaRN's) when it is a plain scalar."""
    try:
        value = ast.literal_eval(text)
    except ValueError:
        if not isinstance(value, bool | int | float | str):
            return f"`{text}`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value is None:
        return "`none`"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def render() -> str:
    """The whole docs/CONFIG.md page."""
    sections = schema_sections()
    out = [HEADER]
    for section in dataclasses.fields(config_schema.JobConfig):
        section_class = section.type
        assert isinstance(section_class, str)  # the schema's annotations are strings
        doc, fields = sections[section_class]
        defaults = {
            f.name: f.default for f in dataclasses.fields(getattr(config_schema, section_class))
        }
        out += [f"## [{section.name}]", ""]
        if doc:
            out += [" ".join(doc.split()), ""]
        out += ["| key | default | meaning |", "|---|---|---|"]
        for f in fields:
            meaning = f.comment
            if f.choices:
                meaning += (
                    (" " if meaning else "")
                    + "One of: "
                    + ", ".join(f"`{c}`" for c in f.choices)
                    + "."
                )
            default = _default(f.default, defaults[f.name])
            out.append(f"| `{section.name}.{f.name}` | {default} | {meaning} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    target = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"
    target.write_text(render())  # our own page, not a user file
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
