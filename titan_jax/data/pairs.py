"""Preference pairs as training rows: one pair a row, for DPO (train/dpo.py).

A store of pairs (store.py, version 3) holds pair i as documents 2i (prompt + chosen) and
2i + 1 (prompt + rejected), each with its loss mask (the completion's assistant tokens). A row
of S tokens holds one pair whole: the chosen sequence, then the rejected one, then padding.
"inputs" is (S, 3) as with document masking (data/windows.py): per token its id, its segment
(`CHOSEN`, `REJECTED`, `PADDING`: attention stays inside each) and its RoPE position, restarting
at 0 with each sequence, so each sequence is computed as if alone (TRL's concatenated forward
runs them as separate rows). Labels are -100 except on the completions' tokens. One pair a row
keeps a pair on one data shard and in one microbatch: its log-probabilities are summed there.

A pair longer than the row is cut as TRL's `max_length` with `truncation_mode="keep_start"` cuts
a sequence: the longer sequence loses its end until the pair fits (both keep S / 2 when both
are longer). A sequence cut inside its prompt has no completion token left; such a pair is not
counted (train/dpo.py), as TRL drops it.

Samples are pairs: sample k of a run is pair perm_e(k mod P) (`WindowStream`'s keyed O(1)
permutation per epoch), so the iterator state is the number of pairs consumed, whatever S.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from titan_jax.data.dataset import DataError
from titan_jax.data.packing import packed_row
from titan_jax.data.store import Corpus
from titan_jax.data.windows import HeldOutRows, Source, WindowStream

CHOSEN, REJECTED, PADDING = 0, 1, 2  # segment ids of a pair's row


def fitted_lengths(chosen: int, rejected: int, seq_len: int) -> tuple[int, int]:
    """How many tokens of each sequence a row of `seq_len` keeps: all when the pair fits, else
    the longer is cut to what the shorter leaves, and both to half when both exceed it."""
    if chosen + rejected <= seq_len:
        return chosen, rejected
    half = seq_len // 2
    if min(chosen, rejected) <= half:
        return (chosen, seq_len - chosen) if chosen <= rejected else (seq_len - rejected, rejected)
    return seq_len - half, half


def pair_row(
    sequences: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int
) -> dict[str, np.ndarray]:
    """{"inputs": (S, 3) ids, segments, positions; "labels": (S,)} of a pair given as the
    (token ids, loss mask) of its chosen and its rejected sequence (cut to fit:
    `fitted_lengths`): segments `CHOSEN`, `REJECTED`, then `PADDING` (data/packing.py)."""
    (chosen, _), (rejected, _) = sequences
    lengths = fitted_lengths(len(chosen), len(rejected), seq_len)
    cut = [(ids[:n], mask[:n]) for (ids, mask), n in zip(sequences, lengths, strict=True)]
    return packed_row(cut, seq_len)


def read_pair_row(corpus: Corpus, pair: int, seq_len: int) -> dict[str, np.ndarray]:
    """The row of pair `pair` of a store of pairs (`pair_row`)."""
    sequences = []
    for k in (CHOSEN, REJECTED):
        start, stop = corpus.document(2 * pair + k)
        n = min(stop - 1 - start, seq_len)  # without the store's EOS after each document
        sequences.append((corpus.read(start, start + n), corpus.read_mask(start, start + n)))
    return pair_row(sequences, seq_len)


class PairStream(WindowStream):
    """`WindowStream` over a store of preference pairs: a sample is a pair, read as one row."""

    samples_are_windows = False

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        rows: Sequence[int] | None = None,
    ):
        for s in sources:
            if not s.corpus.pairs:
                raise DataError(f"{s.name} holds no preference pairs")
        super().__init__(
            sources,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            seed=seed,
            rows=rows,
            document_mask=True,
            document_positions=True,
        )

    def samples_in(self, corpus: Corpus) -> int:
        return corpus.num_documents // 2

    def read(self, corpus: Corpus, sample: int) -> dict[str, np.ndarray]:
        return read_pair_row(corpus, sample, self.seq_len)


class ValidationPairs(HeldOutRows):
    """Pairs 0, 1, 2, ... of a held-out store in order (`HeldOutRows`)."""

    def __init__(
        self,
        corpus: Corpus,
        *,
        seq_len: int,
        global_batch_size: int,
        rows: Sequence[int] | None = None,
    ):
        if not corpus.pairs:
            raise DataError("the validation store holds no preference pairs")
        super().__init__(corpus, seq_len, global_batch_size, rows)

    def num_samples(self) -> int:
        return self.corpus.num_documents // 2

    def read_sample(self, sample: int) -> dict[str, np.ndarray]:
        return read_pair_row(self.corpus, sample, self.seq_len)
