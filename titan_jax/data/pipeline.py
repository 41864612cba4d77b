"""From the run's config to the corpora training and validation read: one path, token stores.

`training.dataset = "tokens"` reads the stores at `training.dataset_path`; `[[training.mixture]]`
reads several, with weights. Any other source (pydoc, text, jsonl, ...) is prepared into a store
on first use under `{dump_folder}/data/` (named by a hash of the source, its files' sizes and
times, and the tokenizer, so a changed input is prepared again) by process 0 while the others
wait; a process that cannot see process 0's folder (no shared filesystem) prepares its own
copy. For large corpora and pods, run `titan-jax prepare-data` ahead instead.

`training.data_format` "messages" or "prompt_completion": the files hold conversations, rendered
with the chat template into stores that carry a loss mask (data/conversations.py); the
validation files are read the same way. "preference": preference pairs, into stores of pairs
(data/pairs.py reads them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from titan_jax.config import ConfigError, JobConfig
from titan_jax.data.conversations import ChatFormat, encode_documents, load_chat_format
from titan_jax.data.dataset import DataError, Split, read_documents, read_records, source_files
from titan_jax.data.paths import filesystem, join
from titan_jax.data.prepare import prepare_store
from titan_jax.data.store import Corpus, open_corpus, read_manifest
from titan_jax.data.tokenizer import Tokenizer
from titan_jax.data.windows import Source
from titan_jax.errors import root_cause

Barrier = Callable[[str], None]  # every process waits there until all arrive


def process_barrier(name: str) -> None:
    """All JAX processes meet here (a no-op with one)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def chat_format(config: JobConfig) -> ChatFormat | None:
    """The run's conversation format (None: its files hold texts)."""
    t = config.training
    if t.data_format == "text":
        return None
    return load_chat_format(t.data_format, t.chat_template, config.model.tokenizer_path)


def holds_pairs(config: JobConfig) -> bool:
    """The run's data are preference pairs (DPO), read one pair a row (data/pairs.py)."""
    return config.training.data_format == "preference"


def cached_store(
    dataset: str,
    dataset_path: str,
    text_field: str,
    split: Split,
    tokenizer: Tokenizer,
    root: str,
    *,
    is_first: bool,
    barrier: Barrier,
    progress: Callable[[str], None] = lambda _: None,
    chat: ChatFormat | None = None,
) -> str:
    """The store of a (small) source under `root`, prepared by the first process if needed."""
    files = source_files(dataset, dataset_path, split)
    stamps = []
    for file in files if dataset != "pydoc" else ():
        fs, path = filesystem(file)
        info = fs.info(path)
        stamps.append([file, info.get("size"), info.get("mtime")])
    key = json.dumps(
        [
            dataset,
            dataset_path,
            text_field,
            split,
            tokenizer.sha256,
            stamps,
            *([chat.kind, chat.sha256] if chat else []),
        ],
        default=str,
    )
    store = join(root, f"{dataset}-{split}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    for turn in ("first", "rest"):  # process 0 prepares; the others only if they cannot see it
        if (turn == "first") == is_first and read_manifest(store) is None:
            progress(f"preparing {dataset} ({split}) as a token store in {store}")
            try:
                prepare_store(
                    dataset=dataset,
                    dataset_path=dataset_path,
                    text_field=text_field,
                    tokenizer=tokenizer,
                    output=store,
                    split=split,
                    keep_partial=False,  # a fixed input is another store's key
                    chat=chat,
                )
            except OSError as e:  # a full disk, a read-only mount: one line; others keep theirs
                if (cause := root_cause(e)) is None:
                    raise
                raise DataError(
                    f"preparing training.dataset_path={dataset_path} as a token store in "
                    f"{store}: {cause} ({e.filename or store}); fix that and run again"
                ) from None
        if turn == "first":
            barrier(f"titan_jax token store {store}")
    return store


def check_inputs(config: JobConfig, tokenizer: Tokenizer) -> None:
    """Fails on a missing input or store, or another tokenizer's store, before anything is
    written (listing files and reading manifests only)."""
    t, v = config.training, config.validation
    for m in t.mixture:
        open_corpus(m.path, tokenizer, what="training.mixture.path")
    pairs = holds_pairs(config)
    if not t.mixture and t.dataset == "tokens":
        open_corpus(t.dataset_path, tokenizer, pairs=pairs)
    chat = chat_format(config)
    if not t.mixture and t.dataset != "tokens":
        for file in source_files(t.dataset, t.dataset_path, "train"):
            # Each file opens and yields its first document (a conversation: rendered):
            # unreadable, damaged or mistyped files fail here, before the store is written.
            if chat is None:
                next(iter(read_documents(t.dataset, file, t.text_field)), None)
            elif first := next(
                iter(read_records(t.dataset, file, chat.fields, chat.optional_fields)), None
            ):
                encode_documents(*first, chat, tokenizer)
    if v.enable:
        try:
            if v.dataset == "tokens":
                open_corpus(v.dataset_path, tokenizer, what="dataset_path", pairs=pairs)
            else:
                source_files(v.dataset, v.dataset_path, "validation")
        except ValueError as e:
            raise ConfigError(f"validation.{e}") from None


def training_sources(
    config: JobConfig,
    tokenizer: Tokenizer,
    *,
    is_first: bool,
    barrier: Barrier,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Source]:
    t = config.training
    if t.mixture:
        return [
            Source(m.path, open_corpus(m.path, tokenizer, what="training.mixture.path"), m.weight)
            for m in t.mixture
        ]
    pairs = holds_pairs(config)
    if t.dataset == "tokens":
        return [Source(t.dataset_path, open_corpus(t.dataset_path, tokenizer, pairs=pairs))]
    store = cached_store(
        t.dataset,
        t.dataset_path,
        t.text_field,
        "train",
        tokenizer,
        join(config.job.dump_folder, "data"),
        is_first=is_first,
        barrier=barrier,
        progress=progress,
        chat=chat_format(config),
    )
    return [Source(t.dataset, open_corpus(store, tokenizer, pairs=pairs))]


def validation_corpus(
    config: JobConfig, tokenizer: Tokenizer, *, is_first: bool, barrier: Barrier
) -> Corpus:
    v = config.validation
    pairs = holds_pairs(config)
    if v.dataset == "tokens":
        return open_corpus(v.dataset_path, tokenizer, what="validation.dataset_path", pairs=pairs)
    store = cached_store(
        v.dataset,
        v.dataset_path,
        config.training.text_field,
        "validation",
        tokenizer,
        join(config.job.dump_folder, "data"),
        is_first=is_first,
        barrier=barrier,
        chat=chat_format(config),
    )
    return open_corpus(store, tokenizer, what="validation.dataset_path", pairs=pairs)
