"""Whole conversations packed into rows (SFT): best fit decreasing; no conversation split across
rows, each epoch every conversation once; labels exactly the assistants' tokens; bitwise
resume on one or two processes and under context parallelism; too-long conversations keep
their start and are counted; held-out rows in order; the config switch."""

import json

import numpy as np
import pytest

from titan_jax.config import ConfigError, load_config
from titan_jax.data.conversations import load_chat_format
from titan_jax.data.dataset import DataError
from titan_jax.data.packing import (
    ConversationStream,
    ValidationConversations,
    best_fit_decreasing,
    pack_conversations,
)
from titan_jax.data.prepare import prepare_store
from titan_jax.data.store import open_corpus
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.data.windows import IGNORE_INDEX, Source, WindowStream

TOK = load_tokenizer()
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
SEQ_LEN = 256
LONG = 7  # the conversation longer than SEQ_LEN


def _reply(i: int) -> str:
    n = 120 if i == LONG else (i * 7) % 23
    return f"Answer {i}: " + " ".join(WORDS[(i + k) % 11] for k in range(n))


def _conversation(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Question {i}? " + " ".join(WORDS[: i % 5])},
            {"role": "assistant", "content": _reply(i)},
        ]
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """48 conversations of 56 to 131 tokens in two input files, and one of ~400 (longer than
    SEQ_LEN)."""
    root = tmp_path_factory.mktemp("packing")
    src = root / "src"
    src.mkdir()
    for f in range(2):
        (src / f"{f}.jsonl").write_text(
            "".join(json.dumps(_conversation(i)) + "\n" for i in range(f * 24, f * 24 + 24))
        )
    prepare_store(
        dataset="jsonl",
        dataset_path=str(src),
        text_field="text",
        tokenizer=TOK,
        output=str(root / "store"),
        chat=load_chat_format("messages", "", ""),
    )
    return open_corpus(str(root / "store"), TOK)


def _stream(corpus, **kwargs):
    return ConversationStream(
        [Source("chat", corpus)],
        **({"seq_len": SEQ_LEN, "global_batch_size": 4, "seed": 5} | kwargs),
    )


def _conversations(corpus):
    """Each conversation's tokens (EOS left out) and loss mask, by document id."""
    out = []
    for j in range(corpus.num_documents):
        start, stop = corpus.document(j)
        out.append((corpus.read(start, stop - 1), corpus.read_mask(start, stop - 1)))
    return out


def _segments(row):
    """(tokens, positions, labels) of each conversation of a row (the padding after them, if
    any, is the last segment: id 0 at position 0 throughout, trained on nothing)."""
    ids, segments, positions = row["inputs"].T
    last = segments == segments[-1]
    padded = bool(np.all(ids[last] == 0) and np.all(positions[last] == 0))
    if padded:
        assert np.all(row["labels"][last] == IGNORE_INDEX)
    assert np.all(np.diff(segments) >= 0)  # each segment one run of tokens
    return [
        (ids[segments == s], positions[segments == s], row["labels"][segments == s])
        for s in range(segments[-1] + (0 if padded else 1))
    ]


def test_best_fit_decreasing_fills_the_fullest_row_that_fits():
    # 5 opens row 0 (room 3), 4 row 1 (room 4); the first 3 fills row 0, the second row 1
    # (room 1), which the 1 then fills.
    np.testing.assert_array_equal(best_fit_decreasing([3, 5, 3, 4, 1], 8), [0, 0, 1, 1, 1])
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, 2000)
    rows = best_fit_decreasing(lengths.tolist(), 64)
    assert np.bincount(rows, weights=lengths).max() <= 64
    # Items of equal length in another order: the same number of rows.
    for _ in range(3):
        shuffled = rng.permutation(lengths)
        assert best_fit_decreasing(shuffled.tolist(), 64).max() == rows.max()
    assert rows.max() + 1 <= np.ceil(lengths.sum() / 64) * 1.02  # near the bound


def test_no_conversation_is_split_and_each_epoch_holds_every_one_once(corpus):
    conversations = _conversations(corpus)
    by_tokens = {tuple(ids[:SEQ_LEN].tolist()): j for j, (ids, _) in enumerate(conversations)}
    assert len(by_tokens) == len(conversations)  # each conversation is told by its tokens
    stream = _stream(corpus)
    rows_per_epoch = stream.windows[0]
    assert rows_per_epoch < len(conversations)  # several conversations share rows
    for key in range(4):  # any order packs into as many rows: the epoch's length is fixed
        assert len(pack_conversations(stream._lengths[0], SEQ_LEN, key)) == rows_per_epoch
    epochs = []
    for _ in range(3):
        seen = []
        for _ in range(rows_per_epoch // 4):
            batch = next(stream)
            for r in range(4):
                for ids, positions, labels in _segments({k: v[r] for k, v in batch.items()}):
                    j = by_tokens[tuple(ids.tolist())]  # a whole conversation, or its start
                    seen.append(j)
                    full, mask = conversations[j]
                    np.testing.assert_array_equal(ids, full[:SEQ_LEN])
                    np.testing.assert_array_equal(positions, np.arange(len(ids)))
                    # Trained: the store's assistant tokens; the last token has no label.
                    expected = np.where(mask[1 : len(ids)], ids[1:], IGNORE_INDEX)
                    np.testing.assert_array_equal(labels, [*expected, IGNORE_INDEX])
        stream.samples = (stream.samples + rows_per_epoch - 1) // rows_per_epoch * rows_per_epoch
        epochs.append(seen)
    # Whole epochs of 4-row batches: every conversation once (rows_per_epoch % 4 rows left out).
    for seen in epochs:
        assert len(seen) == len(set(seen))
    assert epochs[0] != epochs[1]  # another epoch, another order


def test_labels_are_exactly_the_assistants_replies(corpus):
    held_out = ValidationConversations(corpus, seq_len=SEQ_LEN, global_batch_size=2)
    replies = []
    for batch in held_out.batches():
        for r in range(2):
            for _, _, labels in _segments({k: v[r] for k, v in batch.items()}):
                replies.append(TOK.decode(labels[labels != IGNORE_INDEX].tolist()))
    expected = {f"{_reply(i)}<|im_end|>\n" for i in range(48) if i != LONG}
    assert expected <= set(replies)
    (cut,) = set(replies) - expected  # the long one: its reply up to the row's end
    assert cut.startswith(f"Answer {LONG}:") and "<|im_end|>" not in cut


def test_a_too_long_conversation_keeps_its_start_and_is_counted(corpus):
    stream = _stream(corpus)
    assert stream.truncated == [1]
    assert "48 conversations packed whole" in stream.note
    assert f"1 longer than training.seq_len={SEQ_LEN} keep their first {SEQ_LEN}" in stream.note
    # A row of the long one alone: all its SEQ_LEN tokens, no padding.
    start, _ = corpus.document(LONG)
    plan = pack_conversations(stream._lengths[0], SEQ_LEN, key=None)
    (row,) = [r for r in range(len(plan)) if LONG in plan.row(r)]
    np.testing.assert_array_equal(plan.row(row), [LONG])
    roomy = _stream(corpus, seq_len=512)
    assert roomy.truncated == [0] and "longer" not in roomy.note


def test_resume_at_any_step_on_one_or_two_processes_gives_the_same_batches(corpus):
    full = _stream(corpus)
    reference = [next(full) for _ in range(12)]  # over 2 epochs
    assert full.samples > 2 * full.windows[0]
    halves = (range(2), range(2, 4))
    for step in (0, 3, 7, 11):
        saver = [_stream(corpus, rows=r) for r in halves]
        for _ in range(step):
            for s in saver:
                next(s)
        state = json.loads(json.dumps(saver[0].get_state()))
        assert state == saver[1].get_state()
        one, two = _stream(corpus), [_stream(corpus, rows=r) for r in halves]
        for s in [one, *two]:
            s.set_state(state)
        for b in range(step, 12):
            got_one, got_two = next(one), [next(s) for s in two]
            for k in ("inputs", "labels"):
                np.testing.assert_array_equal(got_one[k], reference[b][k])
                np.testing.assert_array_equal(
                    np.concatenate([g[k] for g in got_two]), reference[b][k]
                )


def test_a_process_holding_some_cp_chunks_gets_their_tokens_of_the_same_rows(corpus):
    spans = [(0, 32), (224, 256)]  # rank 0 of cp 4: chunks 0 and 7 of 8
    whole, held = _stream(corpus), _stream(corpus, spans=spans)
    at = np.r_[0:32, 224:256]
    for _ in range(4):
        expected, got = next(whole), next(held)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k][:, at])


def test_validation_rows_are_in_order_and_the_same_every_time(corpus):
    held_out = ValidationConversations(corpus, seq_len=SEQ_LEN, global_batch_size=4, rows=[1, 3])
    first, again = list(held_out.batches()), list(held_out.batches(max_batches=2))
    assert len(first) == held_out.num_batches == len(held_out.plan) // 4
    for a, b in zip(first, again, strict=False):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    everything = ValidationConversations(corpus, seq_len=SEQ_LEN, global_batch_size=4)
    np.testing.assert_array_equal(next(everything.batches())["inputs"][[1, 3]], first[0]["inputs"])


def test_a_window_runs_state_is_refused_with_a_hint_that_works(corpus):
    windows = WindowStream([Source("chat", corpus)], seq_len=SEQ_LEN, global_batch_size=4, seed=5)
    next(windows)
    with pytest.raises(DataError, match="resume with --training.sft_packing window"):
        _stream(corpus).set_state(windows.get_state())
    stream = _stream(corpus)
    next(stream)
    with pytest.raises(DataError, match="rows of whole conversations, this run reads rows of"):
        windows.set_state(stream.get_state())


def test_sft_packing_needs_document_masks_or_the_window_path():
    sft = ["--training.data_format", "messages", "--training.document_mask", "false"]
    with pytest.raises(ConfigError, match="training.sft_packing='window'"):
        load_config("configs/qwen3_debug.toml", sft)
    assert load_config("configs/qwen3_debug.toml", [*sft, "--training.sft_packing", "window"])
    load_config("configs/qwen3_debug_sft.toml", [])
