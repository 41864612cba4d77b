"""Document sources, read as streams of texts one input file at a time (never a file set whole).

Sources (`dataset`, `dataset_path`, `text_field`):
  pydoc    CPython's embedded help text, `pydoc_data.topics.topics` (one document per topic,
           sorted by topic name). The default; needs no path and no download. Every
           `PYDOC_HELD_OUT_EVERY`-th topic (sorted positions 0, 10, 20, ...) is held out: the
           "validation" split, whose texts the "train" split never contains.
  text     .txt files. Documents are blocks separated by blank (empty or whitespace-only) lines,
           so one big file such as a play or a book still shuffles at paragraph granularity.
  jsonl    one JSON object per line, text in `text_field`; .jsonl, .jsonl.gz, .jsonl.zst.
  parquet  column `text_field`, read a row group at a time.
  hf_disk  a HF `datasets` dataset written by `save_to_disk` (split "train" of a DatasetDict).
For text/jsonl/parquet, `dataset_path` is a file, a directory (searched recursively) or a glob,
local or any fsspec URL (gs://, s3://, memory://). `prepare-data` (data/prepare.py) turns a source
into a token store; training reads only stores.

jsonl and parquet files of conversations (SFT) are read as records (`read_records`): whole JSON
objects, or the named columns of each row; data/conversations.py renders them.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
from collections.abc import Iterator
from typing import IO, Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from titan_jax.data.paths import filesystem, glob_files
from titan_jax.errors import TitanJaxError

DATASETS = ("pydoc", "text", "jsonl", "parquet", "hf_disk")
SUFFIXES = {
    "text": (".txt",),
    "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst"),
    "parquet": (".parquet",),
}
# The embedded corpus's held-out slice: every 10th topic in sorted order (8 of 79 topics,
# ~10k of ~128k tokens with the shipped tokenizer).
PYDOC_HELD_OUT_EVERY = 10
Split = Literal["train", "validation"]


class DataError(TitanJaxError, ValueError):
    """A dataset that cannot be read: the message names the path, file, line or field."""


def source_files(dataset: str, dataset_path: str, split: Split = "train") -> list[str]:
    """The input files of a source in their fixed (sorted) order; `pydoc` and `hf_disk` are one
    pseudo-file each. `split` matters for `pydoc` only (its held-out slice)."""
    if dataset not in DATASETS:
        raise DataError(f"dataset={dataset!r} is not one of {list(DATASETS)}")
    if dataset == "pydoc":
        if dataset_path:
            raise DataError(
                f"dataset='pydoc' is embedded and takes no dataset_path={dataset_path!r}"
            )
        return [f"pydoc:{split}"]
    if not dataset_path:
        raise DataError(f"dataset={dataset!r} needs a dataset_path")
    if dataset == "hf_disk":
        return [dataset_path]
    return glob_files(dataset_path, SUFFIXES[dataset], DataError)


def read_documents(dataset: str, file: str, text_field: str) -> Iterator[str]:
    """The documents of one input file, in file order, streamed."""
    if dataset == "pydoc":
        yield from _pydoc(file.partition(":")[2])
    elif dataset == "hf_disk":
        yield from _hf_disk_texts(file, text_field)
    elif dataset == "parquet":
        yield from _parquet_texts(file, text_field)
    else:
        with _open_text(file) as f:
            yield from (_text_blocks(f) if dataset == "text" else _jsonl_texts(f, file, text_field))


def read_records(
    dataset: str, file: str, fields: tuple[str, ...], optional: tuple[str, ...] = ()
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of each record of one jsonl or parquet file, in file order, streamed;
    every record has `fields`, and `optional` where the file has them (a jsonl record keeps all
    its keys; a parquet file is read for these columns only); `where` names its file and line
    (or row) for messages."""
    if dataset == "parquet":
        yield from _parquet_records(file, fields, optional)
        return
    if dataset != "jsonl":
        raise DataError(
            f"dataset={dataset!r} holds texts, not conversations: use jsonl or "
            "parquet files with a `messages` (or `prompt` and `completion`) field"
        )
    with _open_text(file) as f:
        for lineno, record in _jsonl_records(f, file):
            missing = [k for k in fields if not isinstance(record, dict) or k not in record]
            if missing:
                raise DataError(f"{file}:{lineno}: no field {missing[0]!r}")
            yield f"{file}:{lineno}", record


@contextlib.contextmanager
def _open_parquet(file: str) -> Iterator[pq.ParquetFile]:
    fs, path = filesystem(file)
    with fs.open(path, "rb") as f:
        try:
            # Pages written with checksums are verified: their damage is found, not trained on.
            parquet = pq.ParquetFile(f, page_checksum_verification=True)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: not a parquet file ({_one_line(e)})") from None
        yield parquet


def _parquet_records(
    file: str, fields: tuple[str, ...], optional: tuple[str, ...]
) -> Iterator[tuple[str, dict[str, Any]]]:
    with _open_parquet(file) as parquet:
        names = parquet.schema_arrow.names
        missing = [k for k in fields if k not in names]
        if missing:
            raise DataError(f"{file}: no column {missing[0]!r} (columns: {names})")
        columns = [*fields, *(k for k in optional if k in names)]
        row = 0
        for batch in _batches(parquet, file, columns):
            for record in batch.to_pylist():
                yield f"{file} row {row}", record
                row += 1


def _pydoc(split: str) -> list[str]:
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)]
    held_out = texts[::PYDOC_HELD_OUT_EVERY]
    if split == "validation":
        return held_out
    # Some topics share one text ("if" and "else"): train on none of a held-out text.
    return [t for t in texts if t not in set(held_out)]


def _open_text(file: str) -> IO[str]:
    fs, path = filesystem(file)
    try:
        raw: Any = fs.open(path, "rb")
    except OSError as e:
        raise DataError(f"{file} cannot be read: {e.strerror or e}") from None
    if file.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw)
    elif file.endswith(".zst"):
        try:
            import zstandard  # faster where installed; pyarrow's codec otherwise
        except ImportError:
            raw = pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")
        else:
            raw = zstandard.ZstdDecompressor().stream_reader(raw)
    # utf-8-sig: a byte-order mark that opens the file (Windows editors write one) is dropped,
    # not read as part of the first line or document; one anywhere else stays text.
    return io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")


def _lines(f: IO[str], file: str) -> Iterator[tuple[int, str]]:
    try:
        yield from enumerate(f, start=1)
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text ({e})") from e
    except OSError as e:
        raise DataError(f"{file} cannot be read: {e.strerror or e}") from None


def _text_blocks(f: IO[str]) -> Iterator[str]:
    block: list[str] = []
    for _, line in _lines(f, getattr(f, "name", "text file")):
        if line.strip():
            block.append(line)
        elif block:
            yield "".join(block).rstrip()
            block = []
    if block:
        yield "".join(block).rstrip()


def _jsonl_records(f: IO[str], file: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-blank line."""
    for lineno, line in _lines(f, file):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}:{lineno}: not valid JSON ({e})") from e


def _jsonl_texts(f: IO[str], file: str, field: str) -> Iterator[str]:
    for lineno, record in _jsonl_records(f, file):
        if not isinstance(record, dict) or field not in record:
            raise DataError(f"{file}:{lineno}: no field text_field={field!r}")
        if not isinstance(record[field], str):
            raise DataError(f"{file}:{lineno}: field {field!r} is not a string")
        yield record[field]


def _parquet_texts(file: str, field: str) -> Iterator[str]:
    with _open_parquet(file) as parquet:
        names = parquet.schema_arrow.names
        if field not in names:
            raise DataError(f"{file}: no column text_field={field!r} (columns: {names})")
        kind = parquet.schema_arrow.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{file}: column {field!r} has type {kind}, not string")
        for batch in _batches(parquet, file, field):
            column = batch.column(0)
            if column.null_count:
                raise DataError(f"{file}: column {field!r} has {column.null_count} null values")
            yield from column.to_pylist()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _batches(
    parquet: pq.ParquetFile, file: str, field: str | list[str]
) -> Iterator[pa.RecordBatch]:
    groups = parquet.num_row_groups
    columns = [field] if isinstance(field, str) else field
    for group in range(groups):  # one at a time, so that damage is named by its row group
        try:
            yield from parquet.iter_batches(columns=columns, batch_size=1024, row_groups=[group])
        except (pa.ArrowException, OSError) as e:  # damaged data pages under a good footer
            raise DataError(
                f"{file}: column {field!r} is corrupt in row group {group} (of "
                f"{groups}): {_one_line(e)}"
            ) from None


def _hf_disk_texts(path: str, field: str) -> Iterator[str]:
    try:
        import datasets  # imported here: slow to import, and only this source needs it
    except ImportError as e:
        raise DataError("dataset='hf_disk' needs the `datasets` package installed") from e
    fs, local = filesystem(path)
    if not fs.isdir(local):
        raise DataError(f"dataset_path={path!r} does not exist")
    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise DataError(f"dataset_path={path!r} is not a save_to_disk dataset ({e})") from e
    except (ValueError, KeyError, TypeError, OSError) as e:  # a damaged state or info file
        raise DataError(
            f"dataset_path={path!r} is a damaged save_to_disk dataset "
            f"({type(e).__name__}: {_one_line(e)})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"dataset_path={path!r} has splits {list(ds)}, no 'train'")
        ds = ds["train"]
    if field not in ds.column_names:
        raise DataError(
            f"dataset_path={path!r}: no column text_field={field!r} (columns: {ds.column_names})"
        )
    kind = getattr(ds.features[field], "dtype", None) or ds.features[field]
    if kind not in ("string", "large_string"):
        raise DataError(f"dataset_path={path!r}: column {field!r} holds {kind}, not strings")
    # datasets' @transmit_format wrapper widens Dataset.select_columns to Dataset | DatasetDict.
    # pyrefly: ignore[missing-attribute]
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        yield from batch[field]
