"""The docs are reference; dated measurements live in dated notes (docs/notes/YYYY-MM-DD-topic.md).

A measured figure (a time, a size, an MFU, a throughput, stated to a decimal) is stated in one
place of the user docs (README.md, BENCHMARKS.md, docs/*.md), the Makefile and the config
schema's help, so that a new measurement changes one line and no stale copy survives
elsewhere. The Makefile's comments, the config help (and so docs/CONFIG.md) and code comments
hold no time, MFU or throughput figure at all: they link to the note that measured it.
"""

import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTES = ROOT / "docs" / "notes"

# A figure stated to a decimal: round numbers are settings, limits and rules of thumb (`30 s`,
# `5GB` shards), decimals are read off a run.
UNITS = r"(?:ms|µs|us|s|min|GiB|MiB|GB|MB)"
MEASURED = re.compile(
    rf"(?<![\w.])\d+\.\d+\s?{UNITS}(?![\w/])"
    r"|(?<![\w.])\d+(?:\.\d+)?% MFU|MFU (?:of )?\d+(?:\.\d+)?%"
    r"|(?<![\w.])\d[\d,.]*[kM]? tokens/s"
)
# Any time or speed at all: what comments, config help and the Makefile must not state.
TIMING = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|us|s|min|minutes|seconds)(?![\w/])"
    r"|(?<![\w.])\d+(?:\.\d+)?% MFU|MFU (?:of )?\d+(?:\.\d+)?%"
    r"|(?<![\w.])\d[\d,.]*[kM]? tokens/s"
)
# Tables a `make` target rewrites from the code (`make bench-update`, `make plans`, `make docs`):
# their figures are the code's output, regenerated together, so they are not counted as places.
GENERATED = re.compile(
    r"<!-- (\w+):begin -->.*?<!-- \1:end -->|<!-- rules table:.*?<!-- end of rules table -->",
    re.S,
)
# A statement of a run's result in a user doc: a time or speed read off a run (a decimal, a
# range or an approximation: settings are round and exact), a loss or accuracy to two decimals,
# or the words that introduce one. Round settings, limits and formulas do not match.
TIME_UNITS = r"(?:ms|µs|us|s|min|minutes?|seconds?|hours?)"
SPEEDS = r"(?:tokens/s|it/s|steps/s|[GT]FLOP/s)"
RUN_RESULT = re.compile(
    MEASURED.pattern
    + rf"|(?<![\w.])\d+\.\d+\s?{TIME_UNITS}(?![\w/])"
    + rf"|(?<![\w.])\d+(?:\.\d+)?\s?-\s?\d+(?:\.\d+)?\s?{TIME_UNITS}(?![\w/])"
    + rf"|(?:~|\babout |\baround |\broughly )\d[\d,.]*\s?(?:{TIME_UNITS}|{SPEEDS})(?![\w/])"
    + rf"|(?<![\w.])\d[\d,.]*[kM]?\s?{SPEEDS}"
    + r"|\b(?:loss|accuracy)\b[^.;:]{0,60}?(?<![\w.])\d+\.\d{2,}(?![\d%e])"
    + r"|\b(?:[Mm]easured (?:on|here|with|in)\b|on this CPU\b|on \d (?:quiet )?CPU cores|took \d)"
)
NOTE_LINK = re.compile(r"notes/\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md")
# Figures others measured and published, each row naming its source (the estimator's constants
# and its calibration, which titan_jax/planner/ holds too).
PUBLISHED = re.compile(r"<!-- published figures:begin -->.*?<!-- published figures:end -->", re.S)
# Statements of a user doc that state figures of no run of ours, each with why.
ALLOWED_STATEMENTS = {
    ("docs/USAGE.md", "step 220/400"): "a sample of the log line, showing its format",
    ("docs/PARALLELISM.md", "collectives after SPMD"): "inspect's output: static counts, bytes",
    ("docs/PARALLELISM.md", "Across slices PP wins"): "read off the generated table above it",
    ("docs/PARITY.md", "to fetch Qwen3-0.6B"): "the size of the published checkpoint",
    ("docs/TPU.md", "`usable_hbm_bytes`"): "XLA:TPU's limits per chip, read from its refusal",
}

# Times in code comments that are not measurements of ours, each with why.
ALLOWED_TIMINGS = {
    ("titan_jax/cli.py", "30 s"): "gloo's own fixed timeout, the reason for the code below it",
    ("titan_jax/planner/topology.py", "560 us"): "a published worked example, cited by source",
    ("titan_jax/planner/topology.py", "680 us"): "the profile of that published example",
}


def user_pages() -> list[Path]:
    """The hand-written reference: docs/CONFIG.md is generated from the config help (scanned
    as the schema's comments), the notes are dated records, each written once."""
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in pages if p.name != "CONFIG.md"]


def python_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-like string literal of a Python source."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (
            tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))
        ):
            out.append((tok.start[0], tok.string))
    return out


def makefile_comments(source: str) -> list[tuple[int, str]]:
    return [(n, line) for n, line in enumerate(source.splitlines(), 1) if line.startswith("#")]


def figure_places(texts: dict[str, str]) -> dict[str, set[str]]:
    """Each measured figure -> the places (names) stating it, generated tables left out."""
    places: dict[str, set[str]] = defaultdict(set)
    for name, text in texts.items():
        for match in MEASURED.finditer(GENERATED.sub("", text)):
            places[re.sub(r"\s", " ", match.group(0))].add(name)
    return places


def stated_twice(texts: dict[str, str]) -> dict[str, list[str]]:
    return {f: sorted(p) for f, p in figure_places(texts).items() if len(p) > 1}


def scanned_texts() -> dict[str, str]:
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in user_pages()}
    texts["Makefile"] = "\n".join(t for _, t in makefile_comments((ROOT / "Makefile").read_text()))
    schema = (ROOT / "titan_jax" / "config_schema.py").read_text()
    texts["titan_jax/config_schema.py"] = "\n".join(t for _, t in python_comments(schema))
    return texts


def test_each_measured_figure_is_stated_in_one_place():
    twice = stated_twice(scanned_texts())
    assert not twice, f"figures stated in more than one place (keep one, link to it): {twice}"


def test_a_figure_copied_to_a_second_page_is_caught():
    pages = {
        "a.md": "The 235B step is estimated at 3.04 s, 49.2% MFU, peak 46.97 GiB.",
        "b.md": "It runs in 3.04 s a step (was 3.60 s), 49.2% MFU.",
        "c.md": "<!-- tpu_plans:begin -->\n| 235B | 3.04 s |\n<!-- tpu_plans:end -->\n"
        "A 30 s timeout.",
    }
    assert stated_twice(pages) == {"3.04 s": ["a.md", "b.md"], "49.2% MFU": ["a.md", "b.md"]}
    # the generated table and the round setting are not places; one page alone is fine
    assert stated_twice({"a.md": pages["a.md"], "c.md": pages["c.md"]}) == {}


def statements(text: str) -> list[str]:
    """The paragraphs, list items, table rows and fenced blocks of a page: what a link beside a
    figure can vouch for."""
    out: list[list[str]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            if not fenced:
                out.append([])
            fenced = not fenced
        elif fenced:
            out[-1].append(line)
        elif not line.strip():
            out.append([])
        elif re.match(r"\s*(?:[-*] |\d+\. |\||#)", line) or not out:
            out.append([line])
        else:
            out[-1].append(line)
    return ["\n".join(lines) for lines in out if lines]


def unsourced_results(name: str, text: str) -> list[str]:
    """Figures of a run stated on a user page without a link to the note that measured them;
    generated and published tables, inline code (commands, log lines quoted) and the allowed
    statements left out."""
    found = []
    for statement in statements(PUBLISHED.sub("", GENERATED.sub("", text))):
        if NOTE_LINK.search(statement) or any(
            page == name and start in statement for page, start in ALLOWED_STATEMENTS
        ):
            continue
        prose = re.sub(r"`[^`]*`", "", statement)
        found += [f"{name}: {m.group(0)!r}" for m in RUN_RESULT.finditer(prose)]
    return found


def test_user_docs_state_run_results_only_beside_their_note():
    found = []
    for page in user_pages():
        found += unsourced_results(str(page.relative_to(ROOT)), page.read_text())
    assert not found, (
        f"figures of a run in a user doc (move them to a dated note, link it): {found}"
    )


def test_a_run_result_without_its_note_is_caught():
    moved = (
        "With one 1,024-token row a step, its held-out loss on the assistant's tokens falls "
        "from 7.02 (step 4) to 6.49 (step 16) from a random init."
    )
    (found,) = unsourced_results("a.md", moved)  # the line moved out of docs/POSTTRAINING.md
    assert found.endswith("falls from 7.02'") or found.endswith('falls from 7.02"'), found
    pages = {
        "packing.md": "- Packing: ~4 s per million conversations on this CPU.",
        "sweep.md": "Compiling: 25-50 minutes a recipe.",
        "code.md": "```sh\nmake train  # 6.5 s a step\n```",
    }
    for name, text in pages.items():
        assert unsourced_results(name, text), name
    linked = "- Packing: ~4 s per million ([measured](notes/2026-12-06-packing.md))."
    settings = "Heartbeats every 2 s; `distributed.step_timeout=600 s`; a 30 s timeout."
    assert unsourced_results("a.md", linked + "\n\n" + settings) == []


def test_comments_config_help_and_makefile_hold_no_timings():
    found = []
    sources = [(ROOT / "Makefile", makefile_comments)]
    sources += [(p, python_comments) for p in sorted((ROOT / "titan_jax").rglob("*.py"))]
    for path, comments in sources:
        name = str(path.relative_to(ROOT))
        for line, text in comments(path.read_text()):
            for match in TIMING.finditer(text):
                if (name, match.group(0)) not in ALLOWED_TIMINGS:
                    found.append(f"{name}:{line}: {match.group(0)!r}")
    assert not found, f"timings in comments, config help or the Makefile (move to a note): {found}"


def test_notes_are_dated_and_linked():
    """Every note is named YYYY-MM-DD-topic.md and reached from a page; its links resolve."""
    notes = sorted(NOTES.glob("*.md"))
    assert notes
    linked = "\n".join(p.read_text() for p in [*user_pages(), *notes])
    for note in notes:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", note.name), note.name
        assert f"notes/{note.name}" in linked or f"({note.name})" in linked, note.name
    for page in [ROOT / "BENCHMARKS.md", *notes]:
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name}: {link}"
