"""Training and validation batches: fixed windows of token stores, at O(1) cost each.

Window i of a corpus (store.py) is tokens[i*S : i*S + S + 1] (S = seq_len; the tail that makes
no whole window is dropped); inputs = w[:-1], labels = w[1:]. The stream is a sequence of
samples: sample k of row r, batch b is k = b*G + r (G = global batch size). With one source,
sample k is window perm_e(k mod W) of epoch e = k // W, where perm_e is a keyed O(1)-memory
permutation (permutation.py) redrawn from (seed, source, epoch). With a mixture, a fixed table
of `MIXTURE_BLOCK` samples interleaves the sources in proportion to their weights, and sample k
is its source's (k // BLOCK * n_s + rank in block)-th sample: O(1) too.

So a batch is a function of the step alone: a process computes just the rows its devices hold
(`rows`, read off the batch sharding by the trainer), and the iterator state is the number of
samples consumed, valid on any number of processes. A resume with another seq_len continues at
the same token position (samples x seq_len) and says so in `resume_note`.

`document_mask`: "inputs" become (rows, S, 3) int32: per token its id, its segment id (which
document it belongs to inside its window: the model attends only within a segment) and its RoPE
position (restarting at 0 with each document with `document_positions`, else 0..S-1); and the
label predicting a document's first token from the previous document's EOS is IGNORE_INDEX: one
fewer loss token per document boundary inside a window.

A store of conversations (store.py, `loss_mask`) marks the tokens trained on: every other
label (system and user turns, role headers) is IGNORE_INDEX, so the loss is the mean over the
assistants' tokens in the step (train/loss.py divides by the labels not ignored).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from titan_jax.data.dataset import DataError
from titan_jax.data.permutation import Permutation, derive_key
from titan_jax.data.store import Corpus

STATE_VERSION = 3
MIXTURE_BLOCK = 4096  # weights resolve to 1/4096 of the samples, exactly, every block
IGNORE_INDEX = -100  # the loss's ignored label (train/loss.py)


@dataclass
class Source:
    name: str
    corpus: Corpus
    weight: float = 1.0


class Mixture:
    """Sample k -> (source, the source's own sample index), and samples per source so far."""

    def __init__(self, weights: Sequence[float], names: Sequence[str]):
        total = sum(weights)
        quota = [w / total * MIXTURE_BLOCK for w in weights]
        counts = [math.floor(q) for q in quota]
        by_remainder = sorted(range(len(quota)), key=lambda s: counts[s] - quota[s])
        for s in by_remainder[: MIXTURE_BLOCK - sum(counts)]:  # largest remainders round up
            counts[s] += 1
        if min(counts) == 0:
            s = counts.index(0)
            raise DataError(
                f"training.mixture weight {weights[s]} of {names[s]} is below "
                f"1/{MIXTURE_BLOCK} of the total {total}"
            )
        self.counts = np.array(counts, np.int64)
        # Spread each source evenly over the block: its t-th sample sits at (t + 0.5) / n_s.
        order = sorted(((t + 0.5) / n, s, t) for s, n in enumerate(counts) for t in range(n))
        self.source = np.array([s for _, s, _ in order], np.int64)
        self.rank = np.array([t for _, _, t in order], np.int64)
        self.before = np.zeros((len(counts), MIXTURE_BLOCK + 1), np.int64)  # prefix counts
        for s in range(len(counts)):
            self.before[s, 1:] = np.cumsum(self.source == s)

    def __call__(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        block, p = np.divmod(k, MIXTURE_BLOCK)
        source = self.source[p]
        return source, block * self.counts[source] + self.rank[p]

    def samples_per_source(self, k: int) -> np.ndarray:
        """How many of samples [0, k) each source gave."""
        block, p = divmod(k, MIXTURE_BLOCK)
        return block * self.counts + self.before[:, p]


def batch_layout(seq_len: int, document_mask: bool) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Per row of a batch: each field's shape and dtype, as the streams below yield them (the
    trainer's abstract batch, which inspect and compile lower, is built from this)."""
    inputs = (seq_len, 3) if document_mask else (seq_len,)
    return {"inputs": (inputs, np.int32), "labels": ((seq_len,), np.int32)}


def read_row(
    corpus: Corpus,
    start: int,
    seq_len: int,
    document_mask: bool = False,
    document_positions: bool = False,
    spans: Sequence[tuple[int, int]] | None = None,
) -> dict[str, np.ndarray]:
    """The row of the window at token `start`: inputs and labels (document fields with
    `document_mask`); with `spans`, only those token ranges [a, b) of it, concatenated."""
    spans = [(0, seq_len)] if spans is None else spans
    pieces = [corpus.read(start + a, start + b + 1) for a, b in spans]
    inputs = np.concatenate([p[:-1] for p in pieces])
    labels = np.concatenate([p[1:] for p in pieces])
    if corpus.has_loss_mask:  # the label of input t is token t + 1: its mask decides
        trained = np.concatenate([corpus.read_mask(start + a + 1, start + b + 1) for a, b in spans])
        labels[~trained] = IGNORE_INDEX
    if document_mask:
        t = np.concatenate([np.arange(a, b) for a, b in spans])
        return document_fields(corpus, start, inputs, labels, t, seq_len, document_positions)
    return {"inputs": inputs, "labels": labels}


def document_fields(
    corpus: Corpus,
    start: int,
    inputs: np.ndarray,
    labels: np.ndarray,
    t: np.ndarray,
    seq_len: int,
    restart_positions: bool,
) -> dict[str, np.ndarray]:
    """{"inputs": ids, segment ids, positions (len(t), 3); "labels" with boundaries ignored}
    of the window's tokens at positions `t` (all of 0..S-1, or a process's chunks)."""
    ends = corpus.document_ends(start, start + seq_len + 1) - start  # in (0, S + 1]
    segment = np.searchsorted(ends, t, side="right")
    first = np.concatenate([[0], ends])[segment]  # where each token's document starts here
    labels = labels.copy()
    labels[np.isin(t + 1, ends[ends <= seq_len])] = IGNORE_INDEX
    positions = t - first if restart_positions else t
    return {
        "inputs": np.stack([inputs, segment, positions], axis=-1).astype(np.int32),
        "labels": labels,
    }


class WindowStream:
    """Yields this process's rows (ascending) of every global batch: int32 (len(rows), S)
    arrays "inputs" and "labels" ((rows, S, 3) inputs with `document_mask`).

    `spans`: under context parallelism, the token ranges [a, b) of each row this process's
    devices hold, in the order they hold them (the trainer's `batches.spans`); only those are
    read, and the rows are their concatenation (None: whole rows)."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        rows: Sequence[int] | None = None,
        document_mask: bool = False,
        document_positions: bool = False,
        spans: Sequence[tuple[int, int]] | None = None,
    ):
        if seq_len < 1 or global_batch_size < 1:
            raise DataError(
                f"seq_len={seq_len} and global_batch_size={global_batch_size} must be >= 1"
            )
        self.sources, self.seq_len, self.seed = list(sources), seq_len, seed
        self.global_batch_size = global_batch_size
        self.rows = list(range(global_batch_size) if rows is None else sorted(set(rows)))
        if not self.rows or not 0 <= self.rows[0] <= self.rows[-1] < global_batch_size:
            raise DataError(
                f"rows {self.rows[:8]} are not rows of a global batch of {global_batch_size}"
            )
        self.document_mask, self.document_positions = document_mask, document_positions
        self.spans = [(0, seq_len)] if spans is None else [(int(a), int(b)) for a, b in spans]
        if any(not 0 <= a < b <= seq_len for a, b in self.spans):
            raise DataError(f"spans {self.spans[:8]} are not token ranges of a window of {seq_len}")
        self.windows = [self.samples_in(s.corpus) for s in self.sources]
        for s, n in zip(self.sources, self.windows, strict=True):
            if n == 0:
                raise DataError(
                    f"{s.name} holds {s.corpus.num_tokens} tokens: not one window "
                    f"of seq_len + 1 = {seq_len + 1}"
                )
        self.mixture = Mixture([s.weight for s in self.sources], [s.name for s in self.sources])
        self.samples = 0  # consumed so far: the whole iterator state
        self.samples_at_start = 0
        self.resume_note: str | None = None
        self._permutations: dict[tuple[int, int], Permutation] = {}

    # A sample is seq_len tokens: a resume at another seq_len continues at the same token.
    samples_are_windows = True
    # How rows are cut from the stores, recorded in the state where it is not windows: a
    # sample count of one layout means nothing in another.
    packing: str | None = None

    def samples_in(self, corpus: Corpus) -> int:
        """How many samples (windows) a source's corpus holds."""
        return (corpus.num_tokens - 1) // self.seq_len

    def read(self, corpus: Corpus, sample: int) -> dict[str, np.ndarray]:
        """The row of a source's sample (window) `sample`."""
        return read_row(
            corpus,
            sample * self.seq_len,
            self.seq_len,
            self.document_mask,
            self.document_positions,
            self.spans,
        )

    def _permutation(self, source: int, epoch: int) -> Permutation:
        key = (source, epoch)
        if key not in self._permutations:
            if len(self._permutations) > 64:
                self._permutations.clear()
            self._permutations[key] = Permutation(
                self.windows[source], derive_key(self.seed, source, epoch)
            )
        return self._permutations[key]

    def window_index(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples -> (source, window of that source)."""
        source, local = self.mixture(np.asarray(k, np.int64))
        window = np.empty_like(local)
        for s in np.unique(source):
            where = source == s
            epoch, j = np.divmod(local[where], self.windows[s])
            for e in np.unique(epoch):
                at = epoch == e
                j[at] = self._permutation(int(s), int(e))(j[at])
            window[where] = j
        return source, window

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = self.read_samples(self.samples + np.array(self.rows))
        self.samples += self.global_batch_size
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def read_samples(self, k: np.ndarray) -> list[dict[str, np.ndarray]]:
        """The rows of samples `k`."""
        source, window = self.window_index(k)
        return [
            self.read(self.sources[s].corpus, int(w)) for s, w in zip(source, window, strict=True)
        ]

    def source_tokens(self, batches: int) -> dict[str, int]:
        """Tokens each source gave after `batches` batches of this run (for metrics)."""
        k = self.samples_at_start + batches * self.global_batch_size
        return {
            s.name: int(n) * self.seq_len
            for s, n in zip(self.sources, self.mixture.samples_per_source(k), strict=True)
        }

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "sources": [
                [s.name, s.corpus.num_tokens, s.weight, s.corpus.content_sha256]
                for s in self.sources
            ],
            **({"packing": self.packing} if self.packing else {}),
        }

    def _same_stream(self, saved: dict[str, Any]) -> bool:
        """The saved stream is this one: same seed, and per source the same tokens and weight,
        found by content (a store moved or copied to another path resumes) or, for a state
        saved before contents were recorded, by path."""
        current = self._identity()
        if saved.get("seed") != current["seed"] or len(saved.get("sources", [])) != len(
            current["sources"]
        ):
            return False
        for old, new in zip(saved["sources"], current["sources"], strict=True):
            same = old[3] == new[3] if len(old) > 3 else old[0] == new[0]
            if not (same and old[1:3] == new[1:3]):
                return False
        return True

    def get_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "samples": self.samples,
            "seq_len": self.seq_len,
            "stream": self._identity(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"data iterator state has no version {STATE_VERSION} position (it was saved by "
                f"an older titan-jax): {str(state)[:200]}"
            )
        saved_packing = state["stream"].get("packing")
        if saved_packing != self.packing:
            layouts = {None: "windows", "whole": "whole conversations"}
            raise DataError(
                f"data iterator state counts rows of {layouts.get(saved_packing, saved_packing)}"
                f", this run reads rows of {layouts[self.packing]}; resume with "
                f"--training.sft_packing {'window' if saved_packing is None else saved_packing}"
                ", or train in a new job.dump_folder"
            )
        if not self._same_stream(state["stream"]):
            saved = [src[0] for src in state["stream"].get("sources", [])]
            raise DataError(
                f"data iterator state belongs to another stream: the checkpoint read {saved} "
                f"(seed {state['stream'].get('seed')}), this run reads "
                f"{[s.name for s in self.sources]} (seed {self.seed}) with other tokens or "
                "weights; point the run at the checkpoint's stores (copies of them anywhere "
                "will do), or train in a new job.dump_folder"
            )
        samples, saved_len = int(state["samples"]), int(state["seq_len"])
        self.resume_note = None
        if saved_len != self.seq_len and self.samples_are_windows:
            tokens = samples * saved_len
            self.resume_note = (
                f"data: the checkpoint read {samples:,} windows of seq_len {saved_len} "
                f"({tokens:,} tokens); with seq_len {self.seq_len} this run continues at the "
                f"same token position, window {-(-tokens // self.seq_len):,}"
            )
            samples = -(-tokens // self.seq_len)
        self.samples = self.samples_at_start = samples


class HeldOutRows:
    """The same batches every call: samples 0, 1, 2, ... of a held-out corpus in order (batch
    b, row r = sample b*G + r), up to `max_batches` (-1: all whole batches); this process's
    rows. A subclass says how many samples the corpus holds and how one is read."""

    def __init__(
        self, corpus: Corpus, seq_len: int, global_batch_size: int, rows: Sequence[int] | None
    ):
        self.corpus, self.seq_len, self.global_batch_size = corpus, seq_len, global_batch_size
        self.rows = np.array(range(global_batch_size) if rows is None else sorted(set(rows)))

    @property
    def num_batches(self) -> int:
        return self.num_samples() // self.global_batch_size

    def num_samples(self) -> int:
        raise NotImplementedError

    def read_sample(self, sample: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def batches(self, max_batches: int = -1) -> Iterator[dict[str, np.ndarray]]:
        n = self.num_batches if max_batches < 0 else min(max_batches, self.num_batches)
        for b in range(n):
            rows = [self.read_sample(int(i)) for i in b * self.global_batch_size + self.rows]
            yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}


class ValidationWindows(HeldOutRows):
    """Windows of a held-out corpus in order (`HeldOutRows`). `document_mask` /
    `document_positions`: the same fields training reads (WindowStream)."""

    def __init__(
        self,
        corpus: Corpus,
        *,
        seq_len: int,
        global_batch_size: int,
        rows: Sequence[int] | None = None,
        document_mask: bool = False,
        document_positions: bool = False,
    ):
        super().__init__(corpus, seq_len, global_batch_size, rows)
        self.document_mask, self.document_positions = document_mask, document_positions

    def num_samples(self) -> int:
        return (self.corpus.num_tokens - 1) // self.seq_len

    def read_sample(self, sample: int) -> dict[str, np.ndarray]:
        return read_row(
            self.corpus,
            sample * self.seq_len,
            self.seq_len,
            self.document_mask,
            self.document_positions,
        )
