"""Document sources and the grain pipeline that turns them into packed (inputs, labels) batches.

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

Pipeline (TorchTitan semantics): documents shuffled from `seed`, reshuffled every epoch, repeated
forever -> tokenized lazily with EOS appended -> concatenated into one stream and cut into
windows of seq_len + 1 tokens (a document that straddles a cut continues in the next window;
no padding) -> global batches -> inputs = w[:-1], labels = w[1:].

Validation (`validation_batches`): a source's documents in order, read once, tokenized and cut
into seq_len + 1 windows the same way; the same batches every time, so validation losses of
different steps compare.

Multi-process: every process computes the same global stream and keeps rows
[process_index * local_rows, (process_index + 1) * local_rows) of each global batch. Tokenizing the
global batch everywhere costs little next to a train step, and it makes the global batch, and the
iterator state, independent of process_count: a run can resume on a different number of hosts.
"""

import glob
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from grain.experimental import ConcatThenSplitIterDataset

from titan_jax.data.tokenizer import Tokenizer
from titan_jax.errors import TitanJaxError

DATASETS = ("pydoc", "text", "jsonl", "parquet", "hf_disk")
STATE_VERSION = 1
# Documents tokenized ahead by one background thread: enough to hide tokenization behind a
# train step, small enough that a few huge documents cannot eat the host's memory.
PREFETCH_DOCS = 16
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
    except pa.ArrowException as e:
        raise DataError(f"{file}: not a parquet file ({e})") from e
    if field not in names:
        raise DataError(f"{file}: no column text_field={field!r} (columns: {names})")
    column = pq.read_table(file, columns=[field]).column(field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{file}: column {field!r} has type {column.type}, not string")
    if column.null_count:
        raise DataError(f"{file}: column {field!r} has {column.null_count} null values")
    # large_string: offsets of many files together may overflow string's int32.
    return column.cast(pa.large_string())


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
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"dataset_path={path!r} has splits {list(ds)}, no 'train'")
        ds = ds["train"]
    if field not in ds.column_names:
        raise DataError(
            f"dataset_path={path!r}: no column text_field={field!r} (columns: {ds.column_names})"
        )
    return _HFTexts(ds, field)


class TrainIterator:
    """Yields {"inputs", "labels"}: int32 (global_batch_size // process_count, seq_len).

    `get_state()` is a small JSON-serialisable dict: the position in the global stream plus the
    settings that define the stream; `set_state()` refuses a state from a different stream.
    """

    def __init__(self, windows: grain.DatasetIterator, config: dict[str, Any]):
        self._windows = windows
        self._config = config

    def __iter__(self) -> "TrainIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        w = next(self._windows)
        return {"inputs": np.ascontiguousarray(w[:, :-1]), "labels": np.ascontiguousarray(w[:, 1:])}

    def get_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "config": dict(self._config),
            "grain": self._windows.get_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or "grain" not in state:
            raise DataError(
                f"data iterator state has no version {STATE_VERSION} position: {state}"
            )
        saved = state.get("config", {})
        diff = {k: (saved.get(k), v) for k, v in self._config.items() if saved.get(k) != v}
        if diff:
            raise DataError(
                "data iterator state belongs to another stream (saved, current): "
                + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in diff.items())
            )
        self._windows.set_state(_lists_to_tuples(state["grain"]))


def _lists_to_tuples(x: Any) -> Any:
    # JSON turns grain's (start, stop) slice tuples into lists; grain compares them against a
    # (-1, -1) tuple sentinel, so a list would wrongly read as "has a remainder".
    if isinstance(x, dict):
        return {k: _lists_to_tuples(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return tuple(_lists_to_tuples(v) for v in x)
    return x


def build_train_iterator(
    *,
    dataset: str,
    dataset_path: str,
    text_field: str,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> TrainIterator:
    """The training stream of one process; see the module docstring for its semantics."""
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} is not in [0, {process_count})")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise DataError(
            f"global_batch_size={global_batch_size} must be a positive multiple of "
            f"process_count={process_count}"
        )
    if not 0 <= seed < 2**32:
        raise DataError(f"seed={seed} must be in [0, 2**32) (grain's shuffle seed)")
    docs = load_documents(dataset, dataset_path, text_field)

    ds = (
        grain.MapDataset.source(docs)
        .shuffle(seed=seed)
        .repeat(None)  # reseeds the shuffle every epoch
        .map(_tokenize_fn(tokenizer))
        .to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=PREFETCH_DOCS))
    )
    ds = ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
    local_rows = global_batch_size // process_count
    rows = slice(process_index * local_rows, (process_index + 1) * local_rows)
    windows = ds.batch(global_batch_size).map(lambda b: b["tokens"][rows])

    config = {
        "dataset": dataset,
        "text_field": text_field,
        "num_documents": len(docs),
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "seq_len": seq_len,
        "global_batch_size": global_batch_size,
        "seed": seed,
    }
    return TrainIterator(iter(windows), config)


def _tokenize_fn(tokenizer: Tokenizer) -> Callable[[str], dict[str, np.ndarray]]:
    eos = tokenizer.eos_id

    def tokenize(text: str) -> dict[str, np.ndarray]:
        return {"tokens": np.array([*tokenizer.encode(text), eos], dtype=np.int32)}

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
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of up to `max_batches` (-1: all) validation batches: the "validation"
    split's documents in order, with EOS, concatenated and cut into seq_len + 1 windows; a last
    incomplete batch is dropped. Deterministic: every call yields the same batches."""
    docs = load_documents(dataset, dataset_path, text_field, split="validation")
    tokenize = _tokenize_fn(tokenizer)
    window, local_rows = seq_len + 1, global_batch_size // process_count
    rows = slice(process_index * local_rows, (process_index + 1) * local_rows)
    buffer = np.zeros(0, np.int32)
    produced = 0
    for doc in docs:
        if produced == max_batches:
            return
        buffer = np.concatenate([buffer, tokenize(doc)["tokens"]])
        while len(buffer) >= window * global_batch_size and produced != max_batches:
            batch = buffer[: window * global_batch_size].reshape(global_batch_size, window)[rows]
            buffer = buffer[window * global_batch_size:]
            produced += 1
            yield {"inputs": np.ascontiguousarray(batch[:, :-1]),
                   "labels": np.ascontiguousarray(batch[:, 1:])}
