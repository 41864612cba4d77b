"""The training stream: packed (inputs, labels) batches, each process reading only its rows.

Global order, fixed by the documents, `seed`, `seq_len` and the global batch size G (never by
the number of processes): documents are shuffled from `seed`, reshuffled every epoch and repeated
forever, giving a stream of documents. Row r of every global batch is its own *lane*: the stream's
documents r, r + G, r + 2G, ..., tokenized with EOS appended, concatenated and cut into windows
of seq_len + 1 tokens (a document that straddles a cut continues in the lane's next window; no
padding). Batch b's row r is lane r's b-th window; inputs = w[:-1], labels = w[1:].

A process builds only the lanes of the rows its devices hold (`rows`, which the trainer reads
off the batch sharding), so it tokenizes its share of each batch, whatever the number of hosts.
A lane's position is two integers (its next document, and how many of that document's tokens
were used); the iterator state holds all G lanes' positions, gathered from the processes that
hold them, so a checkpoint resumes exactly on any number of processes (with the same G).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from titan_jax.data.dataset import DataError, load_documents, tokenize_fn
from titan_jax.data.tokenizer import Tokenizer

STATE_VERSION = 2
# Epoch permutations kept: lanes drift apart by a few documents, so they read at most a couple of
# epochs at a time; a permutation costs O(documents) to draw.
_EPOCHS_CACHED = 8


class _DocumentOrder:
    """Stream position k -> document index: epoch k // n is a permutation of the n documents,
    drawn from (seed, epoch)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch = functools.lru_cache(maxsize=_EPOCHS_CACHED)(self._permutation)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def __getitem__(self, k: int) -> int:
        epoch, i = divmod(k, self.n)
        return int(self._epoch(epoch)[i])


class _Lane:
    """One row of every global batch: its documents' tokens, cut into windows."""

    def __init__(self, row: int, stride: int, window: int, docs: Sequence[str],
                 order: _DocumentOrder, tokenize: Callable[[str], np.ndarray]):
        self.row, self.stride, self.window = row, stride, window
        self._docs, self._order, self._tokenize = docs, order, tokenize
        self.doc = self.offset = 0  # the lane's next document, and its tokens already used
        self.documents_read = 0  # tokenized by this process (a resume re-reads one)
        self._tokens: np.ndarray | None = None  # the tokens of `doc`, once read

    def _current(self) -> np.ndarray:
        if self._tokens is None:
            index = self._order[self.row + self.doc * self.stride]
            self._tokens = self._tokenize(self._docs[index])
            self.documents_read += 1
        return self._tokens

    def next_window(self) -> np.ndarray:
        out = np.empty(self.window, np.int32)
        filled = 0
        while filled < self.window:
            tokens = self._current()
            take = min(self.window - filled, len(tokens) - self.offset)
            out[filled:filled + take] = tokens[self.offset:self.offset + take]
            filled += take
            self.offset += take
            if self.offset == len(tokens):  # never empty: every document ends with EOS
                self.doc, self.offset, self._tokens = self.doc + 1, 0, None
        return out

    def seek(self, doc: int, offset: int) -> None:
        if doc != self.doc:
            self._tokens = None
        self.doc, self.offset = doc, offset


class TrainIterator:
    """Yields {"inputs", "labels"}: int32 (len(rows), seq_len), this process's rows of each
    global batch, in ascending row order.

    `get_state()` is a small JSON-serialisable dict: every lane's position plus the settings
    that define the stream; with several processes it is a collective (`all_gather`), and every
    process gets the same state. `set_state()` refuses a state from a different stream.
    """

    def __init__(self, lanes: list[_Lane], global_batch_size: int, config: dict[str, Any],
                 all_gather: Callable[[np.ndarray], np.ndarray] | None):
        self._lanes = lanes
        self.global_batch_size = global_batch_size
        self._config = config
        self._all_gather = all_gather

    @property
    def rows(self) -> list[int]:
        return [lane.row for lane in self._lanes]

    @property
    def documents_read(self) -> int:
        """Documents this process tokenized so far."""
        return sum(lane.documents_read for lane in self._lanes)

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        w = np.stack([lane.next_window() for lane in self._lanes])
        return {"inputs": np.ascontiguousarray(w[:, :-1]), "labels": np.ascontiguousarray(w[:, 1:])}

    def positions(self) -> np.ndarray:
        """(global_batch_size, 2) int32: (document, offset) of each lane of this process, -1 in
        rows it does not read."""
        positions = np.full((self.global_batch_size, 2), -1, np.int32)
        for lane in self._lanes:
            positions[lane.row] = (lane.doc, lane.offset)
        return positions

    def get_state(self) -> dict[str, Any]:
        positions = self.positions()
        if self._all_gather is not None:
            # Replicas of a row (tensor parallelism across hosts) hold equal positions.
            positions = np.asarray(self._all_gather(positions)).max(axis=0)
        missing = np.flatnonzero(positions[:, 0] < 0)
        if missing.size:
            raise DataError(f"no process reads rows {missing.tolist()} of the global batch")
        return {"version": STATE_VERSION, "config": dict(self._config),
                "lanes": positions.tolist()}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or "lanes" not in state:
            raise DataError(
                f"data iterator state has no version {STATE_VERSION} position (it was saved by "
                f"an older titan-jax): {str(state)[:200]}")
        saved = state.get("config", {})
        diff = {k: (saved.get(k), v) for k, v in self._config.items() if saved.get(k) != v}
        if diff:
            raise DataError(
                "data iterator state belongs to another stream (saved, current): "
                + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in diff.items())
            )
        for lane in self._lanes:
            lane.seek(*state["lanes"][lane.row])


def build_train_iterator(
    *,
    dataset: str,
    dataset_path: str,
    text_field: str,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    rows: Sequence[int] | None = None,
    all_gather: Callable[[np.ndarray], np.ndarray] | None = None,
) -> TrainIterator:
    """The training stream's `rows` (None: all) of every global batch; see the module docstring.
    `all_gather` (several processes): stacks every process's array, for `get_state`."""
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1")
    if global_batch_size < 1:
        raise DataError(f"global_batch_size={global_batch_size} must be >= 1")
    rows = range(global_batch_size) if rows is None else sorted(set(rows))
    if not rows or not 0 <= rows[0] <= rows[-1] < global_batch_size:
        raise DataError(f"rows {list(rows)[:8]} are not rows of a global batch of "
                        f"{global_batch_size}")
    if not 0 <= seed < 2**32:
        raise DataError(f"seed={seed} must be in [0, 2**32)")
    docs = load_documents(dataset, dataset_path, text_field)
    order = _DocumentOrder(len(docs), seed)
    tokenize = tokenize_fn(tokenizer)
    lanes = [_Lane(r, global_batch_size, seq_len + 1, docs, order, tokenize) for r in rows]
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
    return TrainIterator(lanes, global_batch_size, config, all_gather)
