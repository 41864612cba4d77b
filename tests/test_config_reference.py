"""docs/CONFIG.md is the schema's own description: every field has a comment, and the page
is what `make docs` generates from them (so a new key, or a changed comment, shows up there)."""

import dataclasses
from pathlib import Path

from titan_jax import config_schema
from titan_jax.tools.config_reference import render, schema_sections

PAGE = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"


def test_every_field_has_a_comment_and_appears():
    sections = schema_sections()
    for section in dataclasses.fields(config_schema.JobConfig):
        cls = getattr(config_schema, section.type)  # the schema's annotations are strings
        _, fields = sections[cls.__name__]
        assert [f.name for f in fields] == [f.name for f in dataclasses.fields(cls)]
        assert not [f.name for f in fields if not f.comment], cls.__name__


def test_page_is_current():
    assert PAGE.read_text() == render(), "docs/CONFIG.md is stale: run `make docs`"


def test_reading_a_comment():
    source = (
        'from typing import Literal\nclass A:\n    """Doc."""\n\n    # Above,\n'
        '    # two lines.\n    x: int = 1  # after\n    y: Literal["a", "b"] = "a"\n'
    )
    ((doc, (x, y)),) = schema_sections(source).values()
    assert doc == "Doc."
    assert (x.name, x.default, x.comment) == ("x", "1", "Above, two lines. after")
    assert (y.choices, y.comment) == (("a", "b"), "")


def test_the_rules_table_in_the_docs_is_the_code_s():
    """docs/ARCHITECTURE.md and PARALLELISM.md show `parallel/rules.py`'s table, generated."""
    from titan_jax.tools.sharding_reference import PAGES, render_table, with_table

    for page in PAGES:
        text = page.read_text()
        assert text == with_table(text), f"{page.name}'s rules table is stale: run `make docs`"
    assert "| `embed` | `(fsdp, cp, ep)` | gathered |" in render_table()
