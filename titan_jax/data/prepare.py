"""`prepare-data`: a source's documents -> a token store (format: data/store.py), streamed.

Each input file is read a chunk of documents at a time, tokenized (HF tokenizers' batch
encoding, EOS after each document) in `workers` processes, and appended to its shard in input
order, so the bytes never depend on the worker count. A local store is built in a hidden
sibling (`.NAME.titan-jax-partial`) renamed into place when its manifest is written; a remote one
(gs://...) is written in place, its manifest last (a folder without one is not a store). Each
shard's files are written as temporaries and renamed, then recorded in `shard-NNNNN.json`: a
rerun after a crash (kill -9 included) keeps the recorded shards and redoes the rest, and ends
with the same bytes as an uninterrupted run.

Several machines: `num_shards` N and `shard_index` I give machine I the input files i with
i % N == I; each writes a store of its own, and training reads them together (store.py).

Conversations (`chat`, data/conversations.py): each record is rendered with the chat template
and tokenized whole; the shard gets a loss mask beside its tokens (a version 2 store; preference
pairs, two documents each: version 3).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np
import tokenizers

from titan_jax.atomic_dir import hidden_name
from titan_jax.data.conversations import ChatFormat, encode_conversations
from titan_jax.data.dataset import DataError, Split, read_documents, read_records, source_files
from titan_jax.data.paths import filesystem, is_local, join
from titan_jax.data.store import (
    FORMAT,
    MANIFEST,
    MASKED_VERSION,
    PAIRS_VERSION,
    VERSION,
    StoreError,
    mask_name,
    read_manifest,
    shard_names,
    token_dtype,
)
from titan_jax.data.tokenizer import Tokenizer

CHUNK_CHARS = 1 << 20  # ~1 MB of text per tokenizing task
# Tokenizing is CPU-bound: more processes than this only cost memory (a tokenizer each).
MAX_WORKERS_PER_CPU = 4
# An encoded chunk: (tokens as bytes, each document's length, the loss mask as bytes or None).
Block = tuple[bytes, np.ndarray, bytes | None]
Document = str | tuple[str, dict[str, Any]]  # a text, or (where, record) of a conversation


def _chunks(documents: Iterator[Document]) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    size = 0
    for document in documents:
        chunk.append(document)
        size += len(document if isinstance(document, str) else str(document[1]))
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_chunk(
    tok: Tokenizer, documents: list[Document], dtype: str, chat: ChatFormat | None = None
) -> Block:
    """(tokens with EOS after each document, as `dtype` bytes; each document's length; for
    conversations, their loss mask, 0 on the EOS)."""
    if chat is not None:
        ids, masks = encode_conversations(documents, chat, tok)
    else:  # without a chat format every document is a text (read_documents)
        texts = [d for d in documents if isinstance(d, str)]
        assert len(texts) == len(documents), "a conversation without its chat format"
        ids, masks = tok.encode_batch(texts), None
    lengths = np.array([len(x) + 1 for x in ids], np.int64)
    out = np.empty(int(lengths.sum()), dtype)
    ends = np.cumsum(lengths)
    out[ends - 1] = tok.eos_id
    for end, length, x in zip(ends, lengths, ids, strict=True):
        out[end - length : end - 1] = x
    if masks is None:
        return out.tobytes(), lengths, None
    mask = np.zeros(len(out), np.uint8)
    for end, length, m in zip(ends, lengths, masks, strict=True):
        mask[end - length : end - 1] = m
    return out.tobytes(), lengths, mask.tobytes()


_WORKER: Tokenizer | None = None
_WORKER_CHAT: ChatFormat | None = None


def _init_worker(text: str, eos_id: int, chat: ChatFormat | None, parent: int) -> None:
    global _WORKER, _WORKER_CHAT
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _WORKER = Tokenizer(tokenizers.Tokenizer.from_str(text), eos_id=eos_id)
    _WORKER_CHAT = chat
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    """A worker ends when its parent is gone: a parent killed with SIGKILL cannot shut its pool
    down, and the workers would wait on its queue for ever."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _encode_in_worker(documents: list[Document], dtype: str) -> Block:
    assert _WORKER is not None
    return encode_chunk(_WORKER, documents, dtype, _WORKER_CHAT)


class _Encoder:
    """(file index, chunk) items -> (file index, encoded chunk) in order, in this process or a
    pool; an item with chunk None (a file's end) passes through. At most 2 chunks a worker are
    in flight, so memory stays bounded whatever the file sizes; chunks of the next files are
    encoded while the current file's are written."""

    def __init__(self, tok: Tokenizer, workers: int, dtype: str, chat: ChatFormat | None):
        self.tok, self.dtype, self.chat = tok, dtype, chat
        self.pool = (
            None
            if workers <= 1
            else ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tok.to_json(), tok.eos_id, chat, os.getpid()),
            )
        )
        self.depth = 2 * max(1, workers)

    def _submit(self, chunk: list[Document] | None) -> Any:
        if chunk is None:
            return None
        if self.pool is None:
            return encode_chunk(self.tok, chunk, self.dtype, self.chat)
        return self.pool.submit(_encode_in_worker, chunk, self.dtype)

    def map(self, items: Iterator[tuple[int, list[Document] | None]]) -> Iterator[tuple[int, Any]]:
        """A damaged input raises only after what was read before it: the files before the
        damaged one are finished (and kept for a rerun) whatever the read-ahead."""
        pending: collections.deque[tuple[int, Any]] = collections.deque()
        damage = None
        try:
            for i, chunk in items:
                pending.append((i, self._submit(chunk)))
                if len(pending) >= self.depth:
                    yield self._result(*pending.popleft())
        except DataError as e:
            damage = e
        while pending:
            yield self._result(*pending.popleft())
        if damage is not None:
            raise damage

    @staticmethod
    def _result(i: int, job: Any) -> tuple[int, Any]:
        return i, job.result() if isinstance(job, Future) else job

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _write_atomic(fs: Any, path: str, data: bytes) -> None:
    with fs.open(path + ".tmp", "wb") as f:
        f.write(data)
    fs.mv(path + ".tmp", path)


def _write_shard(
    fs: Any, folder: str, index: int, blocks: Iterator[Block], masked: bool
) -> dict[str, Any]:
    """Streams one input file's encoded chunks into its shard (and its loss mask, `masked`);
    returns its manifest entry."""
    keys = ("tokens_sha256", "docs_sha256", *(("mask_sha256",) if masked else ()))
    paths = [
        join(folder, name)
        for name in (*shard_names(index), *((mask_name(index),) if masked else ()))
    ]
    digests = [hashlib.sha256() for _ in paths]
    n_tokens = n_docs = 0
    try:
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(fs.open(p + ".tmp", "wb")) for p in paths]
            for data, lengths, mask in blocks:
                ends = (np.cumsum(lengths) + n_tokens).astype("<i8").tobytes()
                parts = (data, ends) if mask is None else (data, ends, mask)
                for f, digest, b in zip(files, digests, parts, strict=True):
                    f.write(b)
                    digest.update(b)
                n_tokens += int(lengths.sum())
                n_docs += len(lengths)
    except DataError:  # its input is damaged: no half of its shard stays behind
        fs.rm([p + ".tmp" for p in paths if fs.exists(p + ".tmp")])
        raise
    for p in paths:
        fs.mv(p + ".tmp", p)
    return {
        "file_index": index,
        "tokens": n_tokens,
        "documents": n_docs,
        **{key: digest.hexdigest() for key, digest in zip(keys, digests, strict=True)},
    }


def _request(
    dataset: str,
    dataset_path: str,
    text_field: str,
    split: Split,
    tok: Tokenizer,
    files: list[str],
    num_shards: int,
    shard_index: int,
    chat: ChatFormat | None,
) -> dict[str, Any]:
    what = [dataset, text_field, split, *files]
    if chat is not None:  # another template or format is another store
        what += [chat.kind, chat.sha256]
    inputs = hashlib.sha256("\n".join(what).encode()).hexdigest()
    request: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": token_dtype(tok.vocab_size).str,
        "tokenizer": {
            "sha256": tok.sha256,
            "path": tok.where,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
        },
        "source": {
            "dataset": dataset,
            "dataset_path": dataset_path,
            "text_field": text_field,
            "split": split,
            "files": len(files),
            "inputs_sha256": inputs,
        },
        "part": {"num_shards": num_shards, "shard_index": shard_index},
    }
    if chat is not None and chat.kind == "preference":  # two documents a pair
        request.update(version=PAIRS_VERSION, loss_mask=True, pairs=True)
    elif chat is not None:
        request.update(version=MASKED_VERSION, loss_mask=True)
        request["source"]["chat"] = {
            "format": chat.kind,
            "template": chat.source,
            "template_sha256": chat.sha256,
        }
    return request


def _start_folder(fs: Any, folder: str, request: dict[str, Any]) -> None:
    """Reuses what a crashed run of the same request left in `folder`, never another's."""
    record = join(folder, "request.json")
    if fs.isfile(record):
        with fs.open(record, "rb") as f:
            if json.loads(f.read()) == request:
                return
        fs.rm(folder, recursive=True)  # a crashed run of other inputs: start afresh
    fs.makedirs(folder, exist_ok=True)
    _write_atomic(fs, record, json.dumps(request).encode())


def partial_folder(out_path: str) -> str:
    """The hidden sibling a local store is built in, renamed to `out_path` when complete."""
    parent, _, name = out_path.rstrip("/").rpartition("/")
    return join(parent, hidden_name(name, "partial"))


def prepare_store(
    *,
    dataset: str,
    dataset_path: str,
    text_field: str,
    tokenizer: Tokenizer,
    output: str,
    split: Split = "train",
    workers: int = 1,
    num_shards: int = 1,
    shard_index: int = 0,
    progress: Callable[[str], None] = lambda _: None,
    keep_partial: bool = True,
    chat: ChatFormat | None = None,
) -> dict[str, Any]:
    """Writes (or finishes, or finds already written) the store at `output`; its manifest.
    An input found damaged part way leaves the shards finished so far for a rerun to keep, or
    (`keep_partial=False`) nothing. `chat`: the source holds conversations, rendered so."""
    cpus = os.cpu_count() or 1
    if not 1 <= workers <= MAX_WORKERS_PER_CPU * cpus:
        raise DataError(
            f"--workers={workers} must be in [1, {MAX_WORKERS_PER_CPU * cpus}] "
            f"({MAX_WORKERS_PER_CPU} per CPU; this machine has {cpus})"
        )
    if not 0 <= shard_index < num_shards:
        raise DataError(f"--shard-index={shard_index} must be in [0, --num-shards={num_shards})")
    files = source_files(dataset, dataset_path, split)
    mine = [(i, f) for i, f in enumerate(files) if i % num_shards == shard_index]
    if not mine:
        raise DataError(
            f"--num-shards={num_shards} exceeds the {len(files)} input files of "
            f"dataset_path={dataset_path!r}: shard {shard_index} would be empty"
        )
    request = _request(
        dataset, dataset_path, text_field, split, tokenizer, files, num_shards, shard_index, chat
    )
    done = read_manifest(output)
    if done is not None:
        same = {**done, "tokenizer": {**done["tokenizer"], "path": tokenizer.where}}
        if {k: same.get(k) for k in request} != request:
            raise StoreError(
                f"{output} holds a token store of other inputs or another tokenizer;"
                " choose a new --output"
            )
        progress(f"{output}: already prepared ({done['tokens']:,} tokens)")
        return done
    fs, out_path = filesystem(output)
    # A remote store is written in place: what a failed run left there (its request.json
    # first) is ours to go on from; anything else in the folder is the user's.
    if (
        fs.exists(out_path)
        and fs.ls(out_path)
        and (is_local(output) or not fs.isfile(join(out_path, "request.json")))
    ):
        raise StoreError(
            f"--output {output} exists and is not a token store; choose a new "
            "folder (nothing of yours is overwritten)"
        )
    local = is_local(output)
    folder = partial_folder(out_path) if local else out_path
    _start_folder(fs, folder, request)
    try:
        entries = _write_shards(
            fs, folder, mine, dataset, text_field, tokenizer, workers, progress, chat
        )
    except (DataError, OSError) as e:  # a damaged input, or a full disk part way
        if not keep_partial:
            fs.rm(folder, recursive=True)
            raise
        if not isinstance(e, DataError):
            raise
        raise DataError(
            f"{e}; the input files finished so far are kept in "
            f"{folder if local else output}: the same command goes on from them "
            "once the file is fixed"
        ) from None
    if not any(e["documents"] for e in entries):
        raise DataError(
            f"dataset={dataset!r} at dataset_path={dataset_path!r} holds no "
            "documents" + (f" in shard {shard_index} of {num_shards}" if num_shards > 1 else "")
        )
    manifest = {
        **request,
        "tokens": sum(e["tokens"] for e in entries),
        "documents": sum(e["documents"] for e in entries),
        "shards": entries,
    }
    _finish(fs, folder, out_path if local else None, manifest)
    progress(
        f"{output}: {manifest['tokens']:,} tokens, {manifest['documents']:,} documents "
        f"from {len(mine)} of {len(files)} input files"
    )
    return manifest


def _finish(fs: Any, folder: str, final: str | None, manifest: dict[str, Any]) -> None:
    """The manifest written last, the resume records dropped, and a local store renamed from
    its hidden sibling to `final`."""
    _write_atomic(fs, join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())
    for entry in manifest["shards"]:
        fs.rm(join(folder, f"shard-{entry['file_index']:05d}.json"))
    fs.rm(join(folder, "request.json"))
    if final is not None:
        if fs.exists(final):  # empty (checked before): a move would land inside it
            fs.rmdir(final)
        fs.mv(folder, final, recursive=True)


def _items(
    todo: list[tuple[int, str]], dataset: str, text_field: str, chat: ChatFormat | None
) -> Iterator[tuple[int, list[Document] | None]]:
    for i, file in todo:
        documents: Iterator[Document] = (
            read_documents(dataset, file, text_field)
            if chat is None
            else read_records(dataset, file, chat.fields, chat.optional_fields)
        )
        yield from ((i, c) for c in _chunks(documents))
        yield i, None  # the file's end: its shard exists even when it holds no document


def _file_blocks(encoded: Iterator[tuple[int, Any]], index: int) -> Iterator[Any]:
    """File `index`'s encoded chunks, up to its end item: its shard is done before anything of
    the next file is read (a damaged next file cannot undo it)."""
    for i, block in encoded:
        assert i == index, (i, index)
        if block is None:
            return
        yield block


def _write_shards(
    fs: Any,
    folder: str,
    mine: list[tuple[int, str]],
    dataset: str,
    text_field: str,
    tok: Tokenizer,
    workers: int,
    progress: Callable[[str], None],
    chat: ChatFormat | None,
) -> list[dict[str, Any]]:
    entries: dict[int, dict[str, Any]] = {}
    for i, file in mine:
        record = join(folder, f"shard-{i:05d}.json")
        if fs.isfile(record):  # finished before a crash: kept
            with fs.open(record, "rb") as f:
                entries[i] = json.loads(f.read())
            progress(f"{file}: kept from an earlier run")
    todo = [(i, f) for i, f in mine if i not in entries]
    files = dict(todo)
    encoder = _Encoder(tok, workers, token_dtype(tok.vocab_size).str, chat)
    try:
        encoded = encoder.map(_items(todo, dataset, text_field, chat))
        for i, _ in todo:
            entry = {
                **_write_shard(fs, folder, i, _file_blocks(encoded, i), chat is not None),
                "source": files[i],
            }
            _write_atomic(fs, join(folder, f"shard-{i:05d}.json"), json.dumps(entry).encode())
            entries[i] = entry
            progress(f"[{len(entries)}/{len(mine)}] {files[i]}: {entry['tokens']:,} tokens")
    finally:
        encoder.close()
    return [entries[i] for i, _ in mine]
