"""Training windows of token stores: slices, the O(1) permutation, resume on any process count,
mixtures, document fields, validation windows."""

import json

import numpy as np
import pytest

from titan_jax.data.dataset import DataError
from titan_jax.data.permutation import Permutation, derive_key
from titan_jax.data.prepare import prepare_store
from titan_jax.data.store import open_corpus
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.data.windows import (
    IGNORE_INDEX,
    MIXTURE_BLOCK,
    Source,
    ValidationWindows,
    WindowStream,
    batch_layout,
    read_row,
)

TOK = load_tokenizer()
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two small stores (3 and 1 input files) and their token sequences, tokenized here: the
    documents in file order, each followed by EOS."""
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for name, n_files, n_docs in (("a", 3, 40), ("b", 1, 15)):
        src = root / f"src_{name}"
        src.mkdir()
        texts = []
        for f in range(n_files):
            texts.append(
                [
                    f"{name}{f} {d} " + " ".join(WORDS[(d + k) % 11] for k in range(2 * d))
                    for d in range(n_docs)
                ]
            )
            (src / f"{f}.jsonl").write_text(
                "".join(json.dumps({"text": t}) + "\n" for t in texts[-1])
            )
        prepare_store(
            dataset="jsonl",
            dataset_path=str(src),
            text_field="text",
            tokenizer=TOK,
            output=str(root / name),
        )
        tokens = np.array(
            [t for file in texts for text in file for t in [*TOK.encode(text), TOK.eos_id]],
            np.int32,
        )
        out[name] = (open_corpus(str(root / name), TOK), tokens)
    return out


def _stream(stores, names=("a",), weights=None, **kwargs):
    sources = [
        Source(n, stores[n][0], w) for n, w in zip(names, weights or [1] * len(names), strict=True)
    ]
    return WindowStream(sources, **({"seq_len": 16, "global_batch_size": 8, "seed": 3} | kwargs))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 31, 32, 33, 127, 255, 256, 257, 1021, 4097])
def test_permutation_is_a_bijection(n):
    p = Permutation(n, derive_key(7, n))
    image = p(np.arange(n))
    np.testing.assert_array_equal(np.sort(image), np.arange(n))
    np.testing.assert_array_equal(p.inverse(image), np.arange(n))
    if n > 7:  # keyed: another key is another order
        assert not np.array_equal(Permutation(n, derive_key(8, n))(np.arange(n)), image)


def test_permutation_of_a_huge_domain_without_materialising_it():
    n = 2**40 + 15  # ~1e12 windows: a table would need 8 TB
    p = Permutation(n, derive_key(1, 2))
    i = np.random.default_rng(0).integers(0, n, 20_000)
    j = p(i)
    assert j.min() >= 0 and j.max() < n
    np.testing.assert_array_equal(p.inverse(j), i)  # invertible, hence injective on [0, n)
    assert len(np.unique(j)) == len(np.unique(i))


def test_a_window_is_a_direct_slice_of_the_concatenated_tokens(stores):
    corpus, tokens = stores["a"]
    stream = _stream(stores)
    n_windows = (len(tokens) - 1) // 16
    seen = []
    for step in range(3 * n_windows // 8):  # three epochs
        batch = next(stream)
        _, windows = stream.window_index(step * 8 + np.arange(8))
        for row, w in enumerate(windows):
            np.testing.assert_array_equal(batch["inputs"][row], tokens[w * 16 : w * 16 + 16])
            np.testing.assert_array_equal(batch["labels"][row], tokens[w * 16 + 1 : w * 16 + 17])
        seen.extend(windows)
    epochs = [seen[e * n_windows : (e + 1) * n_windows] for e in range(3)]
    for epoch in epochs[:2]:  # each epoch is every window once, in a new order
        assert sorted(epoch) == list(range(n_windows))
    assert epochs[0] != epochs[1]


def test_resume_at_any_step_on_one_or_two_processes_gives_the_same_batches(stores):
    full = _stream(stores)
    reference = [next(full) for _ in range(12)]
    for step in (0, 1, 5, 11):
        saver = [_stream(stores, rows=r) for r in (range(4), range(4, 8))]
        for _ in range(step):
            for s in saver:
                next(s)
        states = [s.get_state() for s in saver]
        assert states[0] == states[1]  # the state is the step: no gather needed
        state = json.loads(json.dumps(states[0]))
        one = _stream(stores)
        one.set_state(state)
        two = [_stream(stores, rows=r) for r in (range(4), range(4, 8))]
        for s in two:
            s.set_state(state)
        for b in range(step, 12):
            got_one = next(one)
            got_two = np.concatenate([next(s)["inputs"] for s in two])
            np.testing.assert_array_equal(got_one["inputs"], reference[b]["inputs"])
            np.testing.assert_array_equal(got_two, reference[b]["inputs"])


def test_resume_with_another_seq_len_continues_at_the_same_token_position(stores):
    stream = _stream(stores)
    for _ in range(3):
        next(stream)
    longer = _stream(stores, seq_len=32)
    longer.set_state(stream.get_state())
    assert longer.samples == 3 * 8 * 16 // 32
    assert longer.resume_note == (
        "data: the checkpoint read 24 windows of seq_len 16 (384 "
        "tokens); with seq_len 32 this run continues at the same token "
        "position, window 12"
    )
    with pytest.raises(DataError, match="belongs to another stream"):
        _stream(stores, seed=4).set_state(stream.get_state())


def test_a_store_moved_or_copied_elsewhere_resumes_and_another_is_refused_with_a_fix(stores):
    """Sources are matched by what they hold: a byte-identical copy at another path resumes."""
    stream = _stream(stores)
    next(stream)
    state = json.loads(json.dumps(stream.get_state()))
    moved = WindowStream(
        [Source("/elsewhere/a-copy", stores["a"][0])], seq_len=16, global_batch_size=8, seed=3
    )
    moved.set_state(state)
    assert moved.samples == stream.samples
    other = WindowStream([Source("a", stores["b"][0])], seq_len=16, global_batch_size=8, seed=3)
    with pytest.raises(
        DataError,
        match=r"the checkpoint read \['a'\] \(seed 3\), this run "
        r"reads \['a'\] \(seed 3\) with other tokens or weights; point the run "
        "at the checkpoint's stores",
    ):
        other.set_state(state)
    old = {
        **state,
        "stream": {**state["stream"], "sources": [src[:3] for src in state["stream"]["sources"]]},
    }  # saved before contents were recorded
    _stream(stores).set_state(old)
    with pytest.raises(DataError, match="belongs to another stream"):
        moved.set_state(old)


def test_mixture_proportions_hold_and_are_counted_per_source(stores):
    stream = _stream(stores, names=("a", "b"), weights=(3.0, 1.0), global_batch_size=64)
    source, _ = stream.window_index(np.arange(4 * MIXTURE_BLOCK))
    assert np.mean(source == 1) == pytest.approx(0.25, abs=1 / MIXTURE_BLOCK)
    # Every window of 64 samples is within one sample of its share: an even interleave.
    per_batch = source.reshape(-1, 64).sum(axis=1)
    assert per_batch.min() >= 15 and per_batch.max() <= 17
    b_tokens = stores["b"][1]
    batch = next(stream)
    for row in np.flatnonzero(source[:64] == 1):  # rows from "b" are b's windows
        starts = [
            w
            for w in range(len(b_tokens) // 16)
            if np.array_equal(b_tokens[w * 16 : w * 16 + 16], batch["inputs"][row])
        ]
        assert starts
    counts = stream.source_tokens(batches=10)
    assert counts == {
        "a": int(np.sum(source[:640] == 0)) * 16,
        "b": int(np.sum(source[:640] == 1)) * 16,
    }


def test_document_fields_mask_boundaries_and_restart_positions(stores):
    corpus, tokens = stores["a"]
    stream = _stream(stores, document_mask=True, document_positions=True, seq_len=64)
    batch = next(stream)
    assert batch["inputs"].shape == (8, 64, 3)
    ids, segments, positions = (batch["inputs"][..., i] for i in range(3))
    _, windows = stream.window_index(np.arange(8))
    ends = corpus.document_ends(0, corpus.num_tokens)
    boundaries = 0
    for row, w in enumerate(windows):
        start = w * 64
        np.testing.assert_array_equal(ids[row], tokens[start : start + 64])
        doc = np.searchsorted(ends, start + np.arange(64), side="right")  # global document
        np.testing.assert_array_equal(segments[row], doc - doc[0])
        doc_start = np.concatenate([[0], ends])[doc]
        np.testing.assert_array_equal(
            positions[row], np.arange(64) + start - np.maximum(doc_start, start)
        )
        last = np.isin(start + np.arange(64) + 1, ends)  # input is a document's EOS
        assert (tokens[start : start + 64][last] == TOK.eos_id).all()
        boundaries += last.sum()
        labels = batch["labels"][row]
        assert (labels[last] == IGNORE_INDEX).all()
        np.testing.assert_array_equal(labels[~last], tokens[start + 1 : start + 65][~last])
    assert boundaries >= 4  # the check saw masked labels
    plain = next(_stream(stores, document_mask=True, seq_len=64))  # positions not restarted
    np.testing.assert_array_equal(plain["inputs"][..., 2], np.tile(np.arange(64), (8, 1)))


class ReadSpy:
    """A corpus that records the token ranges read from it."""

    def __init__(self, corpus):
        self.corpus, self.reads = corpus, []

    def __getattr__(self, name):
        return getattr(self.corpus, name)

    def read(self, start, stop):
        self.reads.append((start, stop))
        return self.corpus.read(start, stop)


@pytest.mark.parametrize("document_mask", [False, True])
def test_a_process_holding_some_cp_chunks_reads_only_their_tokens(stores, document_mask):
    """cp2, 16-token rows (chunks of 4): the process holding rank 0 reads tokens [0, 4) and
    [12, 16) of each window (+1 for the labels), rank 1 [4, 12); their rows are today's
    whole rows in load-balanced layout, split there."""
    from titan_jax.parallel.context_parallel import held_spans, to_load_balanced

    whole = next(_stream(stores, document_mask=document_mask))
    got = []
    for held, want_spans in ((slice(0, 8), [(0, 4), (12, 16)]), (slice(8, 16), [(4, 12)])):
        spans = held_spans(held, 16, 2)
        assert spans == want_spans
        spy = ReadSpy(stores["a"][0])
        batch = next(
            WindowStream(
                [Source("a", spy)],
                seq_len=16,
                global_batch_size=8,
                seed=3,
                spans=spans,
                document_mask=document_mask,
            )
        )
        assert sorted({(b - a) for a, b in spy.reads}) == sorted({b - a + 1 for a, b in spans})
        assert len(spy.reads) == 8 * len(spans)  # one read per row and span, nothing else
        got.append(batch)
    for key in whole:
        np.testing.assert_array_equal(
            np.concatenate([b[key] for b in got], axis=1), to_load_balanced(whole[key], 2)
        )


def test_validation_windows_are_in_order_and_the_same_every_time(stores):
    corpus, tokens = stores["b"]
    v = ValidationWindows(corpus, seq_len=8, global_batch_size=4)
    first = list(v.batches(2))
    assert len(first) == 2 and len(list(v.batches())) == v.num_batches == (len(tokens) - 1) // 32
    np.testing.assert_array_equal(first[1]["inputs"][2], tokens[6 * 8 : 7 * 8])
    halves = [
        ValidationWindows(corpus, seq_len=8, global_batch_size=4, rows=r).batches(2)
        for r in ([0, 1], [2, 3])
    ]
    np.testing.assert_array_equal(
        np.concatenate([next(h)["labels"] for h in halves]), first[0]["labels"]
    )
    again = list(v.batches(2))
    np.testing.assert_array_equal(again[1]["inputs"], first[1]["inputs"])


@pytest.mark.parametrize("document_mask", [False, True])
def test_both_streams_yield_the_batch_layout_training_is_compiled_for(stores, document_mask):
    corpus, _ = stores["a"]
    train = next(_stream(stores, document_mask=document_mask, document_positions=document_mask))
    held_out = ValidationWindows(
        corpus,
        seq_len=16,
        global_batch_size=8,
        rows=[1, 5],
        document_mask=document_mask,
        document_positions=document_mask,
    )
    validation = next(held_out.batches(1))
    for batch, rows in ((train, 8), (validation, 2)):
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            k: ((rows, *shape), np.dtype(dtype))
            for k, (shape, dtype) in batch_layout(16, document_mask).items()
        }
    for i, window in enumerate([1, 5]):  # validation rows are training's fields of windows
        row = read_row(corpus, window * 16, 16, document_mask, document_mask)
        for k, v in row.items():
            np.testing.assert_array_equal(validation[k][i], v)


def test_bad_stream_settings(stores):
    with pytest.raises(DataError, match=r"rows \[3, 8\] are not rows of a global batch of 8"):
        _stream(stores, rows=[3, 8])
    with pytest.raises(DataError, match="not one window of seq_len"):
        _stream(stores, seq_len=10**6)
    with pytest.raises(DataError, match="weight 1e-05 of b is below 1/4096"):
        _stream(stores, names=("a", "b"), weights=(1.0, 1e-5))
    with pytest.raises(DataError, match="no version 3 position"):
        _stream(stores).set_state({"step": 3})
