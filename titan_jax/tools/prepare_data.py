"""`titan-jax prepare-data`: the config's training source -> a token store (data/prepare.py),
tokenized with the run's tokenizer; `--verify` re-reads a store against its checksums."""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from titan_jax.atomic_dir import hidden_name
from titan_jax.config import ConfigError, JobConfig
from titan_jax.data.dataset import DataError
from titan_jax.data.paths import filesystem, is_local
from titan_jax.data.pipeline import chat_format
from titan_jax.data.prepare import prepare_store
from titan_jax.data.store import open_corpus
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.errors import root_cause
from titan_jax.train.preflight import folder_to_write
from titan_jax.train.run_lock import RunLock


def _progress(message: str) -> None:
    print(f"titan-jax prepare-data: {message}", file=sys.stderr, flush=True)


def prepare_data(
    config: JobConfig,
    output: str,
    *,
    workers: int = 1,
    num_shards: int = 1,
    shard_index: int = 0,
    verify: bool = False,
) -> dict:
    """Writes (or finishes) the store; returns its manifest. `verify`: checks every shard."""
    t = config.training
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    if verify:
        corpus = open_corpus(output, tokenizer, what="--output")
        corpus.verify()
        _progress(
            f"{output}: {len(corpus.shards)} shards, {corpus.num_tokens:,} tokens: "
            "every checksum matches"
        )
        return {"tokens": corpus.num_tokens}
    if t.dataset == "tokens":
        raise ConfigError(
            "training.dataset='tokens' is already a token store; prepare-data "
            "reads a source: pydoc, text, jsonl, parquet or hf_disk"
        )
    start = time.perf_counter()
    messages: list[str] = []

    def progress(message: str) -> None:
        messages.append(message)
        _progress(message)

    with _locked(output), _environment_errors(output):
        manifest = prepare_store(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            text_field=t.text_field,
            tokenizer=tokenizer,
            output=output,
            workers=workers,
            num_shards=num_shards,
            shard_index=shard_index,
            progress=progress,
            chat=chat_format(config),
        )
    seconds = time.perf_counter() - start
    if messages and "already prepared" in messages[-1]:
        return manifest
    _progress(
        f"done in {seconds:.1f} s ({manifest['tokens'] / max(seconds, 1e-9):,.0f} "
        "tokens/s); train from it with --training.dataset tokens "
        f"--training.dataset_path {shlex.quote(output)}"
    )
    return manifest


def _locked(output: str) -> contextlib.AbstractContextManager:
    """One prepare-data a local output: a lock file beside it (the store's folder holds only the
    store). A remote output is not locked (a bucket has no flock): its parts are written in
    place, each machine its own `--shard-index`, and a rerun of the same part writes the same
    bytes (docs/DATA.md)."""
    if not is_local(output):
        return contextlib.nullcontext()
    path = Path(filesystem(output)[1])
    folder_to_write(path, "--output")
    return RunLock(path, "--output", lock_file=path.parent / hidden_name(path.name, "lock"))


@contextlib.contextmanager
def _environment_errors(output: str) -> Iterator[None]:
    """A full disk, a read-only mount or a missing permission: one line naming the path. What
    was finished is kept (the same command goes on from it); other OS errors keep their
    traceback."""
    try:
        yield
    except OSError as e:
        cause = root_cause(e)
        if cause is None:
            raise
        raise DataError(
            f"prepare-data --output {output}: {cause} ({e.filename or output}); "
            "fix that, then run the same command again: it goes on from the input "
            "files finished so far"
        ) from None
