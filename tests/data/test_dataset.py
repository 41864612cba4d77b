import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_jax.data.dataset import read_documents, source_files

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
# 20 distinct documents of 5..172 tokens: shorter and longer than the windows used here.
DOCS = [
    f"doc {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 * i)) for i in range(20)
]


def _write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def load_documents(dataset, path, field, split="train"):
    """Every document of a source, in order (the streams of its files, one after another)."""
    files = source_files(dataset, path, split)
    return [d for f in files for d in read_documents(dataset, f, field)]


def test_pydoc_documents_are_topics_in_sorted_order():
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = load_documents("pydoc", "", "text")
    held_out = load_documents("pydoc", "", "text", split="validation")
    assert list(held_out) == [topics[k] for k in names[::10]]
    assert list(train) == [
        topics[k] for i, k in enumerate(names) if i % 10 and k != "if"
    ]  # "if" has the same text as "else"
    assert not set(train) & set(held_out)  # training never sees the held-out slice


def test_text_source_splits_blank_line_blocks(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("first para\nline two\n\n\n  \n    indented para\n")
    (tmp_path / "sub" / "b.txt").write_text("\n\nonly block in b")
    (tmp_path / "ignored.md").write_text("not text")
    expected = ["first para\nline two", "    indented para", "only block in b"]
    assert list(load_documents("text", str(tmp_path), "")) == expected
    assert list(load_documents("text", str(tmp_path / "a.txt"), "")) == expected[:2]
    assert list(load_documents("text", str(tmp_path / "**" / "b.txt"), "")) == expected[2:]


def test_jsonl_source_with_custom_field(tmp_path):
    _write_jsonl(tmp_path / "1.jsonl", DOCS[:3], field="content")
    (tmp_path / "2.jsonl").write_text(json.dumps({"content": DOCS[3]}) + "\n\n")  # blank line ok
    assert list(load_documents("jsonl", str(tmp_path / "*.jsonl"), "content")) == DOCS[:4]


def test_a_byte_order_mark_opening_a_file_is_not_text(tmp_path):
    """Windows editors open UTF-8 files with a BOM: jsonl parses, the first document is clean."""
    bom = "\ufeff".encode()
    (tmp_path / "a.jsonl").write_bytes(bom + _write_jsonl(tmp_path / "x", DOCS[:2]).read_bytes())
    (tmp_path / "a.txt").write_bytes(bom + b"first\n\nsecond \xef\xbb\xbf\n")
    assert load_documents("jsonl", str(tmp_path / "a.jsonl"), "text") == DOCS[:2]
    assert load_documents("text", str(tmp_path / "a.txt"), "") == ["first", "second \ufeff"]


def test_parquet_source(tmp_path):
    pq.write_table(pa.table({"body": DOCS[:5], "n": list(range(5))}), tmp_path / "a.parquet")
    pq.write_table(
        pa.table({"body": pa.array(DOCS[5:7], pa.large_string())}), tmp_path / "b.parquet"
    )
    docs = load_documents("parquet", str(tmp_path), "body")
    assert docs == DOCS[:7]


def test_hf_disk_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": DOCS[:6], "n": list(range(6))})
    ds.save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": ds.select(range(2, 6))}).save_to_disk(str(tmp_path / "dict"))
    plain = load_documents("hf_disk", str(tmp_path / "plain"), "text")
    assert plain == DOCS[:6]
    assert load_documents("hf_disk", str(tmp_path / "dict"), "text") == DOCS[2:6]


def _setup_bad_sources(tmp: "pytest.TempPathFactory"):
    (tmp / "empty_dir").mkdir()
    (tmp / "blank.txt").write_text("\n   \n\n")
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    (tmp / "badjson.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (tmp / "number.jsonl").write_text('{"text": 3}\n')
    pq.write_table(pa.table({"body": ["x"]}), tmp / "nocol.parquet")
    pq.write_table(pa.table({"text": ["x", None]}), tmp / "nulls.parquet")
    (tmp / "fake.parquet").write_text("not parquet")


@pytest.mark.parametrize(
    "dataset, path, field, match",
    [
        ("c4", "", "text", r"dataset='c4' is not one of \['pydoc', 'text'"),
        ("pydoc", "x.txt", "text", "takes no dataset_path='x.txt'"),
        ("text", "", "text", "dataset='text' needs a dataset_path"),
        ("text", "{tmp}/missing", "text", "dataset_path='{tmp}/missing' does not exist"),
        ("jsonl", "{tmp}/empty_dir", "text", "dataset_path='{tmp}/empty_dir' matches no .jsonl"),
        ("text", "{tmp}/*.none", "text", r"dataset_path='{tmp}/\*.none' matches no .txt"),
        ("text", "{tmp}/latin1.txt", "text", "{tmp}/latin1.txt: not UTF-8 text"),
        ("jsonl", "{tmp}/nofield.jsonl", "text", "nofield.jsonl:2: no field text_field='text'"),
        ("jsonl", "{tmp}/badjson.jsonl", "text", "badjson.jsonl:2: not valid JSON"),
        ("jsonl", "{tmp}/number.jsonl", "text", "number.jsonl:1: field 'text' is not a string"),
        (
            "parquet",
            "{tmp}/nocol.parquet",
            "text",
            r"nocol.parquet: no column text_field='text' \(columns: \['body'\]\)",
        ),
        (
            "parquet",
            "{tmp}/nulls.parquet",
            "text",
            "nulls.parquet: column 'text' has 1 null values",
        ),
        ("parquet", "{tmp}/fake.parquet", "text", "fake.parquet: not a parquet file"),
        ("hf_disk", "{tmp}/missing", "text", "dataset_path='{tmp}/missing' does not exist"),
        ("hf_disk", "{tmp}/empty_dir", "text", "empty_dir' is not a save_to_disk dataset"),
    ],
)
def test_bad_sources_raise_one_clear_line(tmp_path, dataset, path, field, match):
    _setup_bad_sources(tmp_path)
    with pytest.raises(ValueError, match=match.replace("{tmp}", str(tmp_path))) as err:
        load_documents(dataset, path.replace("{tmp}", str(tmp_path)), field)
    assert "\n" not in str(err.value)


def test_hf_disk_missing_column_and_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"body": ["x"]})
    ds.save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"no column text_field='text' \(columns: \['body'\]\)"):
        load_documents("hf_disk", str(tmp_path / "plain"), "text")
    with pytest.raises(ValueError, match=r"has splits \['test'\], no 'train'"):
        load_documents("hf_disk", str(tmp_path / "dict"), "text")


def test_compressed_jsonl_streams(tmp_path):
    import gzip

    _write_jsonl(tmp_path / "a.jsonl", DOCS[:3])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in DOCS[3:5]))
    with pa.CompressedOutputStream(str(tmp_path / "c.jsonl.zst"), "zstd") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in DOCS[5:7]).encode())
    assert load_documents("jsonl", str(tmp_path), "text") == DOCS[:7]


def test_sources_read_fsspec_urls():
    import fsspec

    fs = fsspec.filesystem("memory")
    with fs.open("/src/x/1.jsonl", "w") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:2]))
    with fs.open("/src/x/2.txt", "w") as f:
        f.write("para one\n\npara two\n")
    assert source_files("jsonl", "memory://src/x") == ["memory:///src/x/1.jsonl"]
    assert load_documents("jsonl", "memory://src/x/*.jsonl", "text") == DOCS[:2]
    assert load_documents("text", "memory://src/x", "") == ["para one", "para two"]
