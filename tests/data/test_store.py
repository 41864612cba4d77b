"""prepare-data's token store: contents, determinism (workers, machines, crashes), remote
paths, and the errors a user meets (another tokenizer, a corrupted or missing shard)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest

from titan_jax.data.dataset import DataError
from titan_jax.data.prepare import prepare_store
from titan_jax.data.store import StoreError, open_corpus
from titan_jax.data.tokenizer import load_tokenizer

TOK = load_tokenizer()
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
DOCS = [
    f"doc {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 * i)) for i in range(30)
]


def _jsonl_files(folder: Path, n_files: int = 3) -> list[list[str]]:
    folder.mkdir(parents=True, exist_ok=True)
    parts = [DOCS[i::n_files] for i in range(n_files)]
    for i, part in enumerate(parts):
        (folder / f"part-{i}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in part)
        )
    return parts


def _prepare(src, out, **kwargs):
    return prepare_store(
        dataset="jsonl",
        dataset_path=str(src),
        text_field="text",
        tokenizer=TOK,
        output=str(out),
        **kwargs,
    )


def _tokens(texts):
    return np.array([t for text in texts for t in [*TOK.encode(text), TOK.eos_id]], np.int32)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_store_holds_each_files_documents_with_eos_in_file_order(tmp_path):
    parts = _jsonl_files(tmp_path / "src")
    manifest = _prepare(tmp_path / "src", tmp_path / "store")
    expected = _tokens([t for part in parts for t in part])
    corpus = open_corpus(str(tmp_path / "store"), TOK)
    assert corpus.num_tokens == manifest["tokens"] == len(expected)
    assert manifest["documents"] == len(DOCS) and manifest["dtype"] == "<u2"
    np.testing.assert_array_equal(corpus.read(0, len(expected)), expected)
    np.testing.assert_array_equal(corpus.read(17, 301), expected[17:301])  # across shards
    ends = np.flatnonzero(expected == TOK.eos_id) + 1  # EOS closes every document
    np.testing.assert_array_equal(corpus.document_ends(0, len(expected)), ends)
    np.testing.assert_array_equal(corpus.document_ends(40, 200), ends[(ends > 40) & (ends <= 200)])
    assert not list(tmp_path.glob(".store.titan-jax-partial"))  # renamed into place
    (tmp_path / "empty").mkdir()  # an empty folder given as --output becomes the store
    _prepare(tmp_path / "src", tmp_path / "empty")
    assert _files(tmp_path / "empty") == _files(tmp_path / "store")
    assert [s["file_index"] for s in manifest["shards"]] == [0, 1, 2]


def test_workers_and_machine_split_give_the_same_tokens(tmp_path):
    _jsonl_files(tmp_path / "src", n_files=5)
    _prepare(tmp_path / "src", tmp_path / "one")
    _prepare(tmp_path / "src", tmp_path / "two_workers", workers=2)
    assert _files(tmp_path / "two_workers") == _files(tmp_path / "one")
    for i in range(2):  # two machines: files 0, 2, 4 and 1, 3
        _prepare(tmp_path / "src", tmp_path / f"part{i}", num_shards=2, shard_index=i)
    one = open_corpus(str(tmp_path / "one"), TOK)
    both = open_corpus(f"{tmp_path}/part*", TOK)
    np.testing.assert_array_equal(both.read(0, both.num_tokens), one.read(0, one.num_tokens))
    with pytest.raises(StoreError, match=r"lack input files \[1, 3\] of 5"):
        open_corpus(str(tmp_path / "part0"), TOK)
    with pytest.raises(StoreError, match=r"input files \[0, 2, 4\] appear in two stores"):
        open_corpus(f"{tmp_path}/part0,{tmp_path}/part0,{tmp_path}/part1", TOK)


def test_a_rerun_keeps_finished_shards_and_a_done_store_is_left_alone(tmp_path):
    _jsonl_files(tmp_path / "src")
    _prepare(tmp_path / "src", tmp_path / "clean")
    # A crash after shard 1 was recorded: the partial folder holds it, the store does not exist.
    partial = tmp_path / ".store.titan-jax-partial"
    shutil.copytree(tmp_path / "clean", partial)
    (partial / "manifest.json").unlink()
    messages = []
    _prepare(tmp_path / "src", tmp_path / "elsewhere", progress=messages.append)
    request = json.loads((tmp_path / "elsewhere" / "manifest.json").read_text())
    (partial / "request.json").write_text(
        json.dumps(
            {k: request[k] for k in ("format", "version", "dtype", "tokenizer", "source", "part")}
        )
    )
    (partial / "shard-00001.json").write_text(
        json.dumps(
            {
                **_prepare(tmp_path / "src", tmp_path / "clean")["shards"][1],
                "source": str(tmp_path / "src" / "part-1.jsonl"),
            }
        )
    )
    for name in ("tokens-00000.bin", "docs-00002.bin"):
        (partial / name).unlink()
    (partial / "tokens-00002.bin.tmp").write_bytes(b"torn")
    messages = []
    _prepare(tmp_path / "src", tmp_path / "store", progress=messages.append)
    assert sum("kept from an earlier run" in m for m in messages) == 1
    assert any("part-1.jsonl: kept from an earlier run" in m for m in messages)
    assert _files(tmp_path / "store") == _files(tmp_path / "clean")
    assert _prepare(tmp_path / "src", tmp_path / "store", progress=messages.append)
    assert "already prepared" in messages[-1]
    # What a crashed run of other inputs left is not taken for this one's.
    shutil.copytree(tmp_path / "clean", partial)
    (partial / "request.json").write_text("{}")
    (partial / "shard-00000.json").write_text(json.dumps({"file_index": 0, "tokens": 1}))
    (partial / "manifest.json").unlink()
    messages = []
    _prepare(tmp_path / "src", tmp_path / "store2", progress=messages.append)
    assert not any("kept" in m for m in messages)
    assert _files(tmp_path / "store2") == _files(tmp_path / "clean")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("a file of the user's")
    with pytest.raises(StoreError, match="exists and is not a token store"):
        _prepare(tmp_path / "src", tmp_path / "other")


def test_a_remote_store_is_written_and_read_by_byte_range(tmp_path):
    _jsonl_files(tmp_path / "src")
    _prepare(tmp_path / "src", tmp_path / "local")
    fs = fsspec.filesystem("memory")
    _prepare(tmp_path / "src", "memory://bucket/store")
    assert fs.isfile("/bucket/store/manifest.json")
    remote, local = (
        open_corpus("memory://bucket/store", TOK),
        open_corpus(str(tmp_path / "local"), TOK),
    )
    np.testing.assert_array_equal(remote.read(5, 400), local.read(5, 400))
    np.testing.assert_array_equal(remote.document_ends(0, 400), local.document_ends(0, 400))
    fs.pipe("/bucket/store/tokens-00002.bin", b"\0\0")  # checked at the shard's first read
    damaged = open_corpus("memory://bucket/store", TOK)
    with pytest.raises(
        StoreError, match="shard memory://bucket/store/tokens-00002.bin is corrupted: 2 bytes"
    ):
        damaged.read(0, damaged.num_tokens)
    fs.rm("/bucket", recursive=True)


def test_a_store_of_another_tokenizer_is_refused_naming_both(tmp_path):
    _jsonl_files(tmp_path / "src")
    _prepare(tmp_path / "src", tmp_path / "store")
    other_dir = tmp_path / "tok"
    other_dir.mkdir()
    shutil.copy(TOK.where, other_dir / "tokenizer.json")
    (other_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))
    other = load_tokenizer(str(other_dir))
    with pytest.raises(StoreError) as err:
        open_corpus(str(tmp_path / "store"), other)
    message = str(err.value)
    assert "\n" not in message
    assert f"made with tokenizer {TOK.where} (sha256 {TOK.sha256[:12]})" in message
    assert f"not this run's {other_dir / 'tokenizer.json'} (sha256 {other.sha256[:12]})" in message


def test_a_corrupted_or_truncated_shard_is_named(tmp_path, capsys):
    from titan_jax.cli import main

    _jsonl_files(tmp_path / "src")
    _prepare(tmp_path / "src", tmp_path / "store")
    verify = ["prepare-data", "--output", str(tmp_path / "store"), "--verify"]
    assert main(verify) == 0 and "every checksum matches" in capsys.readouterr().err
    shard = tmp_path / "store" / "tokens-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    corpus = open_corpus(str(tmp_path / "store"), TOK)  # sizes agree: opens
    with pytest.raises(StoreError, match=f"shard {shard} is corrupted .sha256"):
        corpus.verify()
    assert main(verify) == 2
    assert capsys.readouterr().err == (
        f"titan-jax: error: shard {shard} is corrupted (sha256 "
        "differs from the manifest); prepare the store again\n"
    )
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(StoreError, match=f"shard {shard} is corrupted: {len(data) - 2} bytes"):
        open_corpus(str(tmp_path / "store"), TOK)
    with pytest.raises(StoreError, match="is not a token store .no manifest.json.; write one"):
        open_corpus(str(tmp_path / "src"), TOK)
    # No hint to prepare a store in memory: another process's memory is not this one's.
    with pytest.raises(
        StoreError,
        match="memory://nowhere is not a token store .no manifest"
        ".json.; a memory:// store lives in the process that wrote it",
    ):
        open_corpus("memory://nowhere", TOK)


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda text: text[: len(text) // 2], "not JSON"),
        (lambda text: "[1, 2]", "is not a version 1, 2, 3 titan-jax token store"),
        (lambda text: text.replace('"tokens": ', '"tokens": -', 1), "tokens=-\\d+ is not the sum"),
        (lambda text: text.replace('"vocab_size": ', '"vocab_size": 100', 1), "dtype="),
        (
            lambda text: text.replace('"shards": [', '"shards": [{"file_index": 99}, ', 1),
            "shard entry",
        ),
        (lambda text: text.replace('"documents": ', '"documents": 1', 1), "documents=1\\d+ is not"),
    ],
)
def test_a_damaged_manifest_is_one_line_naming_it_even_under_verify(
    tmp_path, capsys, damage, problem
):
    from titan_jax.cli import main

    _jsonl_files(tmp_path / "src")
    _prepare(tmp_path / "src", tmp_path / "store")
    manifest = tmp_path / "store" / "manifest.json"
    manifest.write_text(damage(manifest.read_text()))
    with pytest.raises(StoreError, match=f"^{manifest} (is damaged .({problem})|{problem})"):
        open_corpus(str(tmp_path / "store"), TOK)
    assert main(["prepare-data", "--output", str(tmp_path / "store"), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"titan-jax: error: {manifest} ") and err.count("\n") == 1


def test_token_ids_past_the_vocabulary_name_the_shard(tmp_path, capsys):
    """Ids the tokenizer cannot have made (a store edited or of another vocabulary with the same
    tokenizer hash) are named with their shard when read, not found as NaN steps later."""
    from titan_jax.cli import main

    _jsonl_files(tmp_path / "src")
    _prepare(tmp_path / "src", tmp_path / "store")
    shard = tmp_path / "store" / "tokens-00001.bin"
    tokens = np.fromfile(shard, "<u2")
    tokens[7] = TOK.vocab_size + 5
    tokens.tofile(shard)
    corpus = open_corpus(str(tmp_path / "store"), TOK)
    start = int(corpus.starts[1])
    message = (
        f"shard {shard} is corrupted: token 7 is id {TOK.vocab_size + 5}, past the "
        f"tokenizer's vocab_size {TOK.vocab_size}; prepare the store again"
    )
    with pytest.raises(StoreError, match=f"^{message}$"):
        corpus.read(start, start + 16)
    np.testing.assert_array_equal(
        corpus.read(0, 16),
        open_corpus(  # other shards still read
            str(tmp_path / "store"), TOK
        ).read(0, 16),
    )
    assert main(["prepare-data", "--output", str(tmp_path / "store"), "--verify"]) == 2
    assert "sha256 differs" in capsys.readouterr().err  # the checksum is checked first


@pytest.mark.slow
def test_kill_9_during_prepare_data_then_rerun_gives_the_identical_store(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):  # ~0.2 MB each: long enough to be killed part way
        (src / f"{i:02d}.jsonl").write_text(
            "".join(
                json.dumps(
                    {"text": f"{i} {j} " + " ".join(WORDS[(i * j + k) % 11] for k in range(200))}
                )
                + "\n"
                for j in range(150)
            )
        )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    command = [
        sys.executable,
        "-m",
        "titan_jax.cli",
        "prepare-data",
        "--output",
        str(tmp_path / "store"),
        "--training.dataset",
        "jsonl",
        "--training.dataset_path",
        str(src),
    ]
    partial = tmp_path / ".store.titan-jax-partial"
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(partial.glob("shard-*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = len(list(partial.glob("shard-*.json")))
    assert 1 <= kept < 8 and not (tmp_path / "store").exists()
    messages = []
    _prepare(src, tmp_path / "store", progress=messages.append)
    assert sum("kept from an earlier run" in m for m in messages) >= kept
    _prepare(src, tmp_path / "clean")
    assert _files(tmp_path / "store") == _files(tmp_path / "clean")


def _damage_row_group(path: Path, group: int) -> None:
    """Flips bytes inside the data page of row group `group` (the footer stays valid)."""
    import pyarrow.parquet as pq

    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    data = bytearray(path.read_bytes())
    at = (chunk.data_page_offset + start + chunk.total_compressed_size) // 2  # its data pages
    data[at : at + 16] = bytes(b ^ 0xFF for b in data[at : at + 16])
    path.write_bytes(bytes(data))


def test_a_data_page_damaged_deep_in_a_parquet_file_is_named_and_the_rerun_goes_on(
    tmp_path, capsys
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan_jax.cli import main
    from titan_jax.data.pipeline import cached_store

    src = tmp_path / "src"
    src.mkdir()
    texts = [f"document {i} " + "word " * (i % 13 + 3) for i in range(2000)]
    for i in range(2):
        pq.write_table(
            pa.table({"text": texts}),
            src / f"part-{i}.parquet",
            row_group_size=250,
            write_page_checksum=True,
        )  # unchecked, the flip below reads silently
    clean = prepare_store(
        dataset="parquet",
        dataset_path=str(src),
        text_field="text",
        tokenizer=TOK,
        output=str(tmp_path / "clean"),
    )
    good = (src / "part-1.parquet").read_bytes()
    _damage_row_group(src / "part-1.parquet", 6)  # of 8; the first document reads fine
    argv = [
        "prepare-data",
        "--training.dataset",
        "parquet",
        "--training.dataset_path",
        str(src),
        "--output",
        str(tmp_path / "store"),
    ]
    assert main(argv) == 2
    *progress, err = capsys.readouterr().err.splitlines()
    partial = tmp_path / ".store.titan-jax-partial"
    assert progress == [f"titan-jax prepare-data: [1/2] {src / 'part-0.parquet'}: 54,868 tokens"]
    assert err == (
        f"titan-jax: error: {src / 'part-1.parquet'}: column 'text' is corrupt in row "
        "group 6 (of 8): could not verify page integrity, CRC checksum verification "
        f"failed for page_ordinal 0; the input files finished so far are kept in "
        f"{partial}: the same command goes on from them once the file is fixed"
    )
    assert not (tmp_path / "store").exists()
    assert sorted(p.name for p in partial.iterdir()) == [  # part-0 whole, nothing of part-1
        "docs-00000.bin",
        "request.json",
        "shard-00000.json",
        "tokens-00000.bin",
    ]
    (src / "part-1.parquet").write_bytes(good)  # the hint, followed
    assert main(argv) == 0
    assert "part-0.parquet: kept from an earlier run" in capsys.readouterr().err
    assert _files(tmp_path / "store") == _files(tmp_path / "clean") and clean["shards"]
    # A small source prepared on first use under the dump folder leaves nothing behind.
    _damage_row_group(src / "part-1.parquet", 6)
    with pytest.raises(DataError, match="row group 6 .of 8.: could not verify"):
        cached_store(
            "parquet",
            str(src),
            "text",
            "train",
            TOK,
            str(tmp_path / "cache"),
            is_first=True,
            barrier=lambda _: None,
        )
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_hint_for_a_folder_that_is_no_store_works_with_spaces_in_its_path(tmp_path):
    """The command in the hint is pasted into a shell: its path is quoted."""
    import shlex

    folder = tmp_path / "my corpus"
    _jsonl_files(folder)
    with pytest.raises(StoreError) as error:
        open_corpus(str(folder), TOK)
    command = str(error.value).split("`")[1]
    assert shlex.split(command)[-2:] == ["--output", str(folder)]
