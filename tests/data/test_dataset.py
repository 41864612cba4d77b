import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_jax.data.dataset import load_documents
from titan_jax.data.stream import build_train_iterator
from titan_jax.data.tokenizer import load_tokenizer

TOK = load_tokenizer()
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
# 20 distinct documents of 5..172 tokens: shorter and longer than the windows used here.
DOCS = [
    f"doc {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 * i)) for i in range(20)
]


def _write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _iterator(**overrides):
    kwargs = dict(
        dataset="pydoc",
        dataset_path="",
        text_field="text",
        tokenizer=TOK,
        seq_len=32,
        global_batch_size=8,
        seed=0,
    )
    return build_train_iterator(**(kwargs | overrides))


def _take(it, n):
    return [next(it) for _ in range(n)]


def _windows(batches):
    """Rows of seq_len + 1 tokens, in stream order, rebuilt from (inputs, labels)."""
    return np.concatenate([np.concatenate([b["inputs"], b["labels"][:, -1:]], 1) for b in batches])


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["labels"], y["labels"])


def test_batch_shapes_dtypes_and_shifted_labels():
    batch = next(_iterator())
    assert set(batch) == {"inputs", "labels"}
    for v in batch.values():
        assert v.shape == (8, 32) and v.dtype == np.int32
        assert v.min() >= 0 and v.max() < TOK.vocab_size
    np.testing.assert_array_equal(batch["labels"][:, :-1], batch["inputs"][:, 1:])


def test_stream_is_shuffled_documents_with_eos_reshuffled_each_epoch(tmp_path):
    path = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    # One row: its lane is the whole document stream.
    it = _iterator(dataset="jsonl", dataset_path=str(path), seq_len=16, global_batch_size=1)
    tokenized = [TOK.encode(d) for d in DOCS]
    three_epochs = 3 * sum(len(t) + 1 for t in tokenized)
    stream = _windows(_take(it, three_epochs // 17 + 1)).reshape(-1).tolist()

    pieces, start = [], 0
    for i, token in enumerate(stream):
        if token == TOK.eos_id:
            pieces.append(stream[start:i])
            start = i + 1
    tokenized = [TOK.encode(d) for d in DOCS]
    orders = [[tokenized.index(p) for p in pieces[e * 20 : (e + 1) * 20]] for e in range(3)]
    for order in orders:
        assert sorted(order) == list(range(20))  # every document exactly once per epoch
    assert orders[0] != list(range(20)) and len({tuple(o) for o in orders}) == 3


def test_row_r_packs_documents_r_r_plus_g_r_plus_2g_of_the_stream(tmp_path):
    from titan_jax.data.stream import _DocumentOrder

    path = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    g, seq_len = 3, 40
    batches = _take(_iterator(dataset="jsonl", dataset_path=str(path), seq_len=seq_len,
                              global_batch_size=g, seed=5), 6)
    order = _DocumentOrder(len(DOCS), 5)
    for r in range(g):
        lane = np.concatenate([[*TOK.encode(DOCS[order[r + j * g]]), TOK.eos_id]
                               for j in range(40)])
        windows = np.concatenate([np.r_[b["inputs"][r], b["labels"][r, -1:]] for b in batches])
        np.testing.assert_array_equal(windows, lane[:len(windows)])


def test_same_seed_same_batches_other_seed_differs():
    first = _take(_iterator(seed=7), 3)
    _assert_same(first, _take(_iterator(seed=7), 3))
    other = _take(_iterator(seed=8), 3)
    assert not np.array_equal(first[0]["inputs"], other[0]["inputs"])


def test_state_restore_after_json_round_trip_at_every_step(tmp_path):
    path = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    kwargs = dict(dataset="jsonl", dataset_path=str(path), seq_len=8, global_batch_size=2)
    it = _iterator(**kwargs)
    reference = _take(_iterator(**kwargs), 34)
    # Every position: a window cut inside a document and exactly at a document end.
    for step in range(30):
        state = json.loads(json.dumps(it.get_state()))
        assert len(json.dumps(state)) < 1000
        resumed = _iterator(**kwargs)
        resumed.set_state(state)
        _assert_same(_take(resumed, 4), reference[step : step + 4])
        _assert_same([next(it)], reference[step : step + 1])


def test_row_subsets_are_the_global_batch_and_tokenize_only_their_rows():
    full = _iterator()
    global_batches = _take(full, 3)
    for parts in ([range(4), range(4, 8)], [[0, 2, 5], [1, 3, 4, 6, 7]]):
        iterators = [_iterator(rows=rows) for rows in parts]
        locals_ = [_take(it, 3) for it in iterators]
        for step, batch in enumerate(global_batches):
            for key in ("inputs", "labels"):
                for rows, local in zip(parts, locals_, strict=True):
                    np.testing.assert_array_equal(local[step][key], batch[key][list(rows)])
        # Each row is its own lane: the parts read the whole batch's documents between them.
        assert sum(it.documents_read for it in iterators) == full.documents_read
        assert all(0 < it.documents_read < full.documents_read for it in iterators)


def test_state_moves_between_process_counts():
    """Two processes' gathered state resumes one process, and one's resumes two."""
    single = _iterator()
    _take(single, 2)
    state = single.get_state()
    expected = _take(single, 2)
    # Each half's get_state gathers both halves' positions (as process_allgather would).
    gather = lambda _: np.stack([h.positions() for h in halves])  # noqa: E731
    halves = [_iterator(rows=range(4), all_gather=gather), _iterator(rows=range(4, 8))]
    for half in halves:
        half.set_state(state)
    for step, want in enumerate(expected):
        got = [next(half) for half in halves]
        np.testing.assert_array_equal(np.concatenate([g["inputs"] for g in got]),
                                      want["inputs"], err_msg=f"step {step}")
    resumed = _iterator()
    resumed.set_state(json.loads(json.dumps(halves[0].get_state())))
    _assert_same(_take(resumed, 2), _take(single, 2))
    with pytest.raises(ValueError, match=r"no process reads rows \[0, 1, 2, 3\]"):
        halves[1].get_state()


def test_state_from_another_stream_is_refused():
    state = _iterator(seq_len=32).get_state()
    with pytest.raises(ValueError, match="seq_len=32 vs 64"):
        _iterator(seq_len=64).set_state(state)
    with pytest.raises(ValueError, match="no version 2 position"):
        _iterator().set_state({"step": 3})


def test_pydoc_documents_are_topics_in_sorted_order():
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = load_documents("pydoc", "", "text")
    held_out = load_documents("pydoc", "", "text", split="validation")
    assert list(held_out) == [topics[k] for k in names[::10]]
    assert list(train) == [topics[k] for i, k in enumerate(names)
                           if i % 10 and k != "if"]  # "if" has the same text as "else"
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
    batch = next(_iterator(dataset="text", dataset_path=str(tmp_path), seq_len=4))
    assert batch["inputs"].shape == (8, 4)


def test_jsonl_source_with_custom_field(tmp_path):
    _write_jsonl(tmp_path / "1.jsonl", DOCS[:3], field="content")
    (tmp_path / "2.jsonl").write_text(json.dumps({"content": DOCS[3]}) + "\n\n")  # blank line ok
    assert list(load_documents("jsonl", str(tmp_path / "*.jsonl"), "content")) == DOCS[:4]


def test_parquet_source(tmp_path):
    pq.write_table(pa.table({"body": DOCS[:5], "n": list(range(5))}), tmp_path / "a.parquet")
    pq.write_table(
        pa.table({"body": pa.array(DOCS[5:7], pa.large_string())}), tmp_path / "b.parquet"
    )
    docs = load_documents("parquet", str(tmp_path), "body")
    assert len(docs) == 7 and [docs[i] for i in range(7)] == DOCS[:7]
    batch = next(_iterator(dataset="parquet", dataset_path=str(tmp_path), text_field="body"))
    assert batch["inputs"].shape == (8, 32)


def test_hf_disk_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": DOCS[:6], "n": list(range(6))})
    ds.save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": ds.select(range(2, 6))}).save_to_disk(str(tmp_path / "dict"))
    plain = load_documents("hf_disk", str(tmp_path / "plain"), "text")
    assert [plain[i] for i in range(len(plain))] == DOCS[:6]
    split = load_documents("hf_disk", str(tmp_path / "dict"), "text")
    assert [split[i] for i in range(len(split))] == DOCS[2:6]
    batch = next(_iterator(dataset="hf_disk", dataset_path=str(tmp_path / "plain"), seq_len=8))
    assert batch["inputs"].shape == (8, 8)


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
        ("text", "{tmp}/blank.txt", "text", "dataset='text' at .*blank.txt' holds no documents"),
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


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(seq_len=0), "seq_len=0 must be >= 1"),
        (dict(rows=[3, 8]), r"rows \[3, 8\] are not rows of a global batch of 8"),
        (dict(rows=[]), r"rows \[\] are not rows of a global batch of 8"),
        (dict(seed=-1), r"seed=-1 must be in \[0, 2\*\*32\)"),
    ],
)
def test_bad_pipeline_settings(overrides, match):
    with pytest.raises(ValueError, match=match):
        _iterator(**overrides)


def test_validation_batches_are_deterministic_and_held_out():
    from titan_jax.data.dataset import validation_batches

    tok = load_tokenizer("")
    kwargs = dict(dataset="pydoc", dataset_path="", text_field="text", tokenizer=tok,
                  seq_len=32, global_batch_size=4)
    first = list(validation_batches(**kwargs, max_batches=3))
    again = list(validation_batches(**kwargs, max_batches=3))
    assert len(first) == 3 and all(b["inputs"].shape == (4, 32) for b in first)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(first[0]["labels"][:, :-1], first[0]["inputs"][:, 1:])
    held_out = load_documents("pydoc", "", "text", split="validation")
    expected = [*tok.encode(held_out[0]), tok.eos_id][:33]
    assert list(first[0]["inputs"][0]) + [first[0]["labels"][0, -1]] == expected
    everything = list(validation_batches(**kwargs))  # -1: the whole slice once
    assert len(everything) > 3
    halves = [list(validation_batches(**kwargs, max_batches=2, rows=rows))
              for rows in ([0, 1], [2, 3])]
    np.testing.assert_array_equal(np.concatenate([halves[0][0]["inputs"], halves[1][0]["inputs"]]),
                                  first[0]["inputs"])
