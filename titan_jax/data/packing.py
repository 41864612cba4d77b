"""Whole conversations packed into rows (SFT): no conversation is split across two rows.

A store of conversations (store.py, with a loss mask) records where each conversation ends.
Each epoch the conversations are shuffled (a keyed permutation of (seed, source, epoch)), then
packed by best fit decreasing, as TRL's `packing_strategy="bfd"` packs: longest first (the
shuffle orders conversations of equal length), each into the row with the least room that
holds it, else into a new row. A row holds its conversations one after another, without the
EOS the store puts after each, then padding: per token its id, its segment (0, 1, ... per
conversation, the next id for the padding: attention never mixes them) and its RoPE position
(restarting at 0 with each conversation), as `document_mask` and `document_positions` lay out
windows (windows.py). A label is trained where the store's mask says so (the assistants'
tokens); padding and each conversation's last token (whose next token is the EOS) are not.

A conversation longer than the row keeps its first `seq_len` tokens (TRL's truncation keeps
the start); `truncated` counts them, and `note` says so. Equal lengths make the same rows
whatever their order, so an epoch has the same number of rows whatever the seed and the epoch:
sample k of a run is row perm_e(k mod R) of epoch e's packing (`WindowStream`'s permutation of
its R rows), and the iterator state is the number of rows consumed, as for windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from titan_jax.data.permutation import Permutation, derive_key
from titan_jax.data.store import Corpus
from titan_jax.data.windows import IGNORE_INDEX, HeldOutRows, Source, WindowStream

_ORDER_SALT = 1  # the conversations' order is keyed apart from the rows' (same seed and epoch)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> np.ndarray:
    """The row of each item (lengths in [1, capacity]), packed longest first into the fullest
    row that holds it; items of equal length are taken in the order given."""
    order = np.argsort(-np.asarray(lengths, np.int64), kind="stable")
    row_of = np.empty(len(order), np.int64)
    rows_with_room: dict[int, list[int]] = {}  # room left -> rows with exactly that much
    has_room = 0  # bit r set: some row has exactly r tokens of room left
    rows = 0
    for i in order.tolist():
        n = int(lengths[i])
        fits = has_room >> n
        if fits:  # the least room >= n: the lowest set bit at or above n
            room = n + (fits & -fits).bit_length() - 1
            waiting = rows_with_room[room]
            row = waiting.pop()
            if not waiting:
                has_room ^= 1 << room
        else:
            row, room = rows, capacity
            rows += 1
        row_of[i] = row
        if room > n:
            waiting = rows_with_room.setdefault(room - n, [])
            if not waiting:
                has_room |= 1 << (room - n)
            waiting.append(row)
    return row_of


@dataclass
class PackedRows:
    """Conversations (document ids of a store) grouped into rows."""

    documents: np.ndarray  # row after row
    offsets: np.ndarray  # row r holds documents[offsets[r] : offsets[r + 1]]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, r: int) -> np.ndarray:
        return self.documents[self.offsets[r] : self.offsets[r + 1]]


def pack_conversations(lengths: np.ndarray, seq_len: int, key: int | None) -> PackedRows:
    """Rows of `seq_len` tokens for conversations of `lengths` tokens (their EOS left out;
    longer ones count as `seq_len`, empty ones are skipped), in the order `key` shuffles them
    (None: store order)."""
    order = (
        np.arange(len(lengths))
        if key is None
        else Permutation(len(lengths), key)(np.arange(len(lengths)))
    )
    order = order[lengths[order] > 0]
    row_of = best_fit_decreasing(np.minimum(lengths[order], seq_len).tolist(), seq_len)
    by_row = np.argsort(row_of, kind="stable")
    counts = np.bincount(row_of, minlength=int(row_of.max(initial=-1)) + 1)
    return PackedRows(order[by_row], np.concatenate([[0], np.cumsum(counts)]))


def packed_row(
    sequences: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int
) -> dict[str, np.ndarray]:
    """{"inputs": (S, 3) ids, segments, positions; "labels": (S,)} of sequences given as
    (token ids, loss mask), each at most S long and together at most S: sequence i is segment
    i, the padding after them segment len(sequences)."""
    ids = np.zeros(seq_len, np.int32)
    segments = np.full(seq_len, len(sequences), np.int32)
    positions = np.zeros(seq_len, np.int32)
    labels = np.full(seq_len, IGNORE_INDEX, np.int32)
    at = 0
    for segment, (tokens, trained) in enumerate(sequences):
        n = len(tokens)
        ids[at : at + n], segments[at : at + n], positions[at : at + n] = (
            tokens,
            segment,
            np.arange(n),
        )
        # The label of token t is token t + 1, trained where its mask is.
        labels[at : at + n - 1] = np.where(np.asarray(trained[1:], bool), tokens[1:], IGNORE_INDEX)
        at += n
    return {"inputs": np.stack([ids, segments, positions], axis=-1), "labels": labels}


def conversation_lengths(corpus: Corpus) -> np.ndarray:
    """Each document's tokens without the EOS the store puts after it."""
    return corpus.document_lengths() - 1


def read_packed_row(corpus: Corpus, documents: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """The row of `documents` (`packed_row`), each cut to its first `seq_len` tokens."""
    sequences = []
    for j in documents.tolist():
        start, stop = corpus.document(j)
        n = min(stop - 1 - start, seq_len)
        sequences.append((corpus.read(start, start + n), corpus.read_mask(start, start + n)))
    return packed_row(sequences, seq_len)


class ConversationStream(WindowStream):
    """`WindowStream` over stores of conversations: a sample is a row of whole conversations.

    `spans` (context parallelism): the token ranges of each row this process's devices hold;
    the row is packed whole and those ranges kept."""

    samples_are_windows = False
    packing = "whole"

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        rows: Sequence[int] | None = None,
        spans: Sequence[tuple[int, int]] | None = None,
    ):
        self._lengths = [conversation_lengths(s.corpus) for s in sources]
        self._plans: dict[tuple[int, int], PackedRows] = {}
        self._rows_per_source: dict[int, int] = {}
        self.seed, self.seq_len = seed, seq_len  # the plans need them before the base's init
        for s in range(len(sources)):
            self._rows_per_source[id(sources[s].corpus)] = len(self._plan(s, 0))
        super().__init__(
            sources,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            seed=seed,
            rows=rows,
            document_mask=True,
            document_positions=True,
            spans=spans,
        )
        self._held = (
            None if spans is None else np.concatenate([np.arange(a, b) for a, b in self.spans])
        )
        self.truncated = [int((n > seq_len).sum()) for n in self._lengths]
        self.note = "; ".join(self._describe(s) for s in range(len(self.sources)))

    def _describe(self, source: int) -> str:
        lengths = self._lengths[source]
        rows, tokens = self.windows[source], int(np.minimum(lengths, self.seq_len).sum())
        cut = self.truncated[source]
        return (
            f"{self.sources[source].name}: {int((lengths > 0).sum()):,} conversations packed "
            f"whole into {rows:,} rows of {self.seq_len} tokens an epoch "
            f"({1 - tokens / (rows * self.seq_len):.1%} padding)"
            + (
                f"; {cut:,} longer than training.seq_len={self.seq_len} keep their first "
                f"{self.seq_len} tokens"
                if cut
                else ""
            )
        )

    def samples_in(self, corpus: Corpus) -> int:
        return self._rows_per_source[id(corpus)]

    def _plan(self, source: int, epoch: int) -> PackedRows:
        key = (source, epoch)
        if key not in self._plans:
            if len(self._plans) >= 2 * len(self._lengths):  # an epoch and the next, per source
                self._plans.clear()
            self._plans[key] = pack_conversations(
                self._lengths[source],
                self.seq_len,
                derive_key(self.seed, source, epoch, _ORDER_SALT),
            )
        return self._plans[key]

    def read_samples(self, k: np.ndarray) -> list[dict[str, np.ndarray]]:
        source, local = self.mixture(np.asarray(k, np.int64))
        _, row = self.window_index(k)
        out = []
        for s, j, r in zip(source.tolist(), local.tolist(), row.tolist(), strict=True):
            plan = self._plan(s, j // self.windows[s])
            packed = read_packed_row(self.sources[s].corpus, plan.row(r), self.seq_len)
            if self._held is not None:
                packed = {name: a[self._held] for name, a in packed.items()}
            out.append(packed)
        return out


class ValidationConversations(HeldOutRows):
    """Held-out conversations packed whole in store order (rows as `ConversationStream` packs
    them, unshuffled), read in order (`HeldOutRows`)."""

    def __init__(
        self,
        corpus: Corpus,
        *,
        seq_len: int,
        global_batch_size: int,
        rows: Sequence[int] | None = None,
    ):
        super().__init__(corpus, seq_len, global_batch_size, rows)
        self.plan = pack_conversations(conversation_lengths(corpus), seq_len, key=None)

    def num_samples(self) -> int:
        return len(self.plan)

    def read_sample(self, sample: int) -> dict[str, np.ndarray]:
        return read_packed_row(self.corpus, self.plan.row(sample), self.seq_len)
