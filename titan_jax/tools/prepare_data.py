"""`titan-jax prepare-data`: the config's training source -> a token store (data/prepare.py),
tokenized with the run's tokenizer; `--verify` re-reads a store against its checksums."""

from __future__ import annotations

import sys
import time

from titan_jax.config import ConfigError, JobConfig
from titan_jax.data.prepare import prepare_store
from titan_jax.data.store import open_corpus
from titan_jax.data.tokenizer import load_tokenizer


def _progress(message: str) -> None:
    print(f"titan-jax prepare-data: {message}", file=sys.stderr, flush=True)


def prepare_data(config: JobConfig, output: str, *, workers: int = 1, num_shards: int = 1,
                 shard_index: int = 0, verify: bool = False) -> dict:
    """Writes (or finishes) the store; returns its manifest. `verify`: checks every shard."""
    t = config.training
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    if verify:
        corpus = open_corpus(output, tokenizer, what="--output")
        corpus.verify()
        _progress(f"{output}: {len(corpus.shards)} shards, {corpus.num_tokens:,} tokens: "
                  "every checksum matches")
        return {"tokens": corpus.num_tokens}
    if t.dataset == "tokens":
        raise ConfigError("training.dataset='tokens' is already a token store; prepare-data "
                          "reads a source: pydoc, text, jsonl, parquet or hf_disk")
    start = time.perf_counter()
    messages: list[str] = []

    def progress(message: str) -> None:
        messages.append(message)
        _progress(message)

    manifest = prepare_store(dataset=t.dataset, dataset_path=t.dataset_path,
                             text_field=t.text_field, tokenizer=tokenizer, output=output,
                             workers=workers, num_shards=num_shards, shard_index=shard_index,
                             progress=progress)
    seconds = time.perf_counter() - start
    if messages and "already prepared" in messages[-1]:
        return manifest
    _progress(f"done in {seconds:.1f} s ({manifest['tokens'] / max(seconds, 1e-9):,.0f} "
              "tokens/s); train from it with --training.dataset tokens "
              f"--training.dataset_path {output}")
    return manifest
