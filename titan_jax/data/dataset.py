"""Document sources, and the validation batches cut from them in order.

Sources (`dataset`, `dataset_path`, `text_field`):
  pydoc    CPython's embedded help text, `pydoc_data.topics.topics` (one document per topic,
           sorted by topic name). The default; needs no path and no download. Every
           `PYDOC_HELD_OUT_EVERY`-th topic (sorted positions 0, 10, 20, ...) is held out: the
           "validation" split, whose texts the "train" split never contains.
  text     .txt files. Documents are blocks separated by blank (empty or whitespace-only) lines,
           so one big file such as a play or a book still shuffles at paragraph granularity.
  jsonl    one JSON object per line, text in `text_field`.
  parquet  column `text_field`, read with pyarrow.
  hf_disk  a HF `datasets` dataset written by `save_to_disk` (split "train" of a DatasetDict).
For text/jsonl/parquet, `dataset_path` is a file, a directory (searched recursively) or a glob.

Training batches: `data/stream.py` (documents shuffled from a seed, tokenized with EOS,
packed into seq_len + 1 windows, each process reading only its rows).

Validation (`validation_batches`): a source's documents in order, read once, tokenized and cut
into seq_len + 1 windows the same way; the same batches every time, so validation losses of
different steps compare.
"""

import glob
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from titan_jax.data.tokenizer import Tokenizer
from titan_jax.errors import TitanJaxError

DATASETS = ("pydoc", "text", "jsonl", "parquet", "hf_disk")
# The embedded corpus's held-out slice: every 10th topic in sorted order (8 of 79 topics,
# ~10k of ~128k tokens with the shipped tokenizer).
PYDOC_HELD_OUT_EVERY = 10
Split = Literal["train", "validation"]


class DataError(TitanJaxError, ValueError):
    """A dataset that cannot be read: the message names the path, file, line or field."""


def load_documents(dataset: str, dataset_path: str, text_field: str,
                   split: Split = "train") -> Sequence[str]:
    """Random-access documents of one source; raises ValueError naming the bad path or field.

    `split` matters for `pydoc` only (its held-out slice); a file source is read whole either
    way: point validation at a file of its own.
    """
    if dataset not in DATASETS:
        raise DataError(f"dataset={dataset!r} is not one of {list(DATASETS)}")
    if dataset == "pydoc":
        if dataset_path:
            raise DataError(
                f"dataset='pydoc' is embedded and takes no dataset_path={dataset_path!r}"
            )
        from pydoc_data.topics import topics

        texts = [topics[k] for k in sorted(topics)]
        held_out = texts[::PYDOC_HELD_OUT_EVERY]
        # Some topics share one text ("if" and "else"): train on none of a held-out text.
        docs: Sequence[str] = held_out if split == "validation" else [
            t for t in texts if t not in set(held_out)]
    elif not dataset_path:
        raise DataError(f"dataset={dataset!r} needs a dataset_path")
    elif dataset == "text":
        docs = [d for f in _files(dataset_path, ".txt") for d in _text_blocks(f)]
    elif dataset == "jsonl":
        docs = [d for f in _files(dataset_path, ".jsonl") for d in _jsonl_texts(f, text_field)]
    elif dataset == "parquet":
        docs = _ArrowTexts(
            [_parquet_texts(f, text_field) for f in _files(dataset_path, ".parquet")]
        )
    else:
        docs = _hf_disk_texts(dataset_path, text_field)
    if len(docs) == 0:
        raise DataError(f"dataset={dataset!r} at dataset_path={dataset_path!r} holds no documents")
    return docs


def _files(path: str, suffix: str) -> list[Path]:
    if any(c in path for c in "*?["):
        files = sorted(p for p in map(Path, glob.glob(path, recursive=True)) if p.is_file())
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).rglob(f"*{suffix}") if p.is_file())
    elif Path(path).is_file():
        files = [Path(path)]
    elif Path(path).exists():
        raise DataError(f"dataset_path={path!r} is neither a regular file nor a folder")
    else:
        raise DataError(f"dataset_path={path!r} does not exist")
    if not files:
        raise DataError(f"dataset_path={path!r} matches no {suffix} files")
    return files


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text ({e})") from e
    except OSError as e:
        raise DataError(f"{file} cannot be read: {e.strerror or e}") from None


def _text_blocks(file: Path) -> list[str]:
    # `\s*` backtracks to the last newline of the run, so the next block keeps its indentation.
    blocks = re.split(r"\n\s*\n", _read_text(file))
    return [b.rstrip() for b in blocks if b.strip()]


def _jsonl_texts(file: Path, field: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(_read_text(file).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}:{lineno}: not valid JSON ({e})") from e
        if not isinstance(record, dict) or field not in record:
            raise DataError(f"{file}:{lineno}: no field text_field={field!r}")
        if not isinstance(record[field], str):
            raise DataError(f"{file}:{lineno}: field {field!r} is not a string")
        texts.append(record[field])
    return texts


def _parquet_texts(file: Path, field: str) -> pa.ChunkedArray:
    try:
        names = pq.read_schema(file).names
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{file}: not a readable parquet file ({_one_line(e)})") from None
    if field not in names:
        raise DataError(f"{file}: no column text_field={field!r} (columns: {names})")
    try:
        column = pq.read_table(file, columns=[field]).column(field)
    except (pa.ArrowException, OSError) as e:  # damaged data pages under a good footer
        raise DataError(f"{file}: column {field!r} is corrupt ({_one_line(e)})") from None
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{file}: column {field!r} has type {column.type}, not string")
    if column.null_count:
        raise DataError(f"{file}: column {field!r} has {column.null_count} null values")
    # large_string: offsets of many files together may overflow string's int32.
    return column.cast(pa.large_string())


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class _ArrowTexts(Sequence[str]):
    """Strings of several Arrow columns, indexed as one sequence without copies into Python."""

    def __init__(self, columns: list[pa.ChunkedArray]):
        self._texts = pa.chunked_array(
            [c for col in columns for c in col.chunks], type=pa.large_string()
        ).combine_chunks()  # one contiguous array: O(1) indexing

    def __len__(self) -> int:
        return len(self._texts)

    def __getitem__(self, i: int) -> str:
        return self._texts[i].as_py()


class _HFTexts(Sequence[str]):
    """One column of a memory-mapped HF dataset, read a row at a time."""

    def __init__(self, ds: Any, field: str):
        self._ds = ds.select_columns([field])
        self._field = field

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i: int) -> str:
        return self._ds[i][self._field]


def _hf_disk_texts(path: str, field: str) -> _HFTexts:
    try:
        import datasets  # imported here: slow to import, and only this source needs it
    except ImportError as e:
        raise DataError("dataset='hf_disk' needs the `datasets` package installed") from e
    if not Path(path).is_dir():
        raise DataError(f"dataset_path={path!r} does not exist")
    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise DataError(f"dataset_path={path!r} is not a save_to_disk dataset ({e})") from e
    except (ValueError, KeyError, TypeError, OSError) as e:  # a damaged state or info file
        raise DataError(f"dataset_path={path!r} is a damaged save_to_disk dataset "
                        f"({type(e).__name__}: {_one_line(e)})") from None
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
    return _HFTexts(ds, field)


def tokenize_fn(tokenizer: Tokenizer) -> Callable[[str], np.ndarray]:
    """A document -> its int32 tokens with EOS appended."""
    eos = tokenizer.eos_id

    def tokenize(text: str) -> np.ndarray:
        return np.array([*tokenizer.encode(text), eos], dtype=np.int32)

    return tokenize


def validation_batches(
    *,
    dataset: str,
    dataset_path: str,
    text_field: str,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    max_batches: int = -1,
    rows: Sequence[int] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """`rows` (None: all) of up to `max_batches` (-1: all) validation batches: the "validation"
    split's documents in order, with EOS, concatenated and cut into seq_len + 1 windows; a last
    incomplete batch is dropped. Deterministic: every call yields the same batches. Every
    process reads the whole (small) split; it keeps the rows its devices hold."""
    docs = load_documents(dataset, dataset_path, text_field, split="validation")
    tokenize = tokenize_fn(tokenizer)
    window = seq_len + 1
    rows = list(range(global_batch_size) if rows is None else sorted(set(rows)))
    buffer = np.zeros(0, np.int32)
    produced = 0
    for doc in docs:
        if produced == max_batches:
            return
        buffer = np.concatenate([buffer, tokenize(doc)])
        while len(buffer) >= window * global_batch_size and produced != max_batches:
            batch = buffer[: window * global_batch_size].reshape(global_batch_size, window)[rows]
            buffer = buffer[window * global_batch_size:]
            produced += 1
            yield {"inputs": np.ascontiguousarray(batch[:, :-1]),
                   "labels": np.ascontiguousarray(batch[:, 1:])}
