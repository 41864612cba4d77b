"""Stores of conversations (SFT): rendered with the chat template, a loss mask beside the tokens,
and windows whose labels are the assistant's tokens only; bad records are one line, nothing
written; the shipped chat set prepares with the shipped tokenizer's template."""

import json

import numpy as np
import pytest

from titan_jax.data.conversations import encode_record, load_chat_format
from titan_jax.data.dataset import DataError
from titan_jax.data.prepare import prepare_store
from titan_jax.data.store import MASKED_VERSION, StoreError, open_corpus, read_manifest
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.data.windows import IGNORE_INDEX, Source, ValidationWindows, WindowStream, read_row

TOK = load_tokenizer()
CHAT = load_chat_format("messages", "", "")
REPLIES = ["Four.", "It is the square of two.", "Nine, three times three."]
CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Two times two?"},
            {"role": "assistant", "content": REPLIES[0]},
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": REPLIES[1]},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Three times three?"},
            {"role": "assistant", "content": REPLIES[2]},
        ]
    },
]


def _write(folder, records, name="chat.jsonl"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _prepare(src, out, fmt=CHAT, **kwargs):
    return prepare_store(
        dataset="jsonl",
        dataset_path=str(src),
        text_field="text",
        tokenizer=TOK,
        output=str(out),
        chat=fmt,
        **kwargs,
    )


def test_a_store_of_conversations_carries_the_assistants_tokens_as_its_labels(tmp_path):
    manifest = _prepare(_write(tmp_path / "src", CONVERSATIONS * 3), tmp_path / "store")
    assert manifest["version"] == MASKED_VERSION and manifest["loss_mask"] is True
    corpus = open_corpus(str(tmp_path / "store"), TOK)
    assert corpus.has_loss_mask
    row = read_row(corpus, 0, corpus.num_tokens - 1)
    trained = row["labels"][row["labels"] != IGNORE_INDEX]
    text = TOK.decode(trained.tolist())
    # Exactly the replies and the end-of-turn marker that closes each (with its newline, see
    # data/chat.py), in order; no prompt.
    assert text == "".join(f"{r}<|im_end|>\n" for r in REPLIES) * 3, text
    assert "Two times two" not in text and "assistant" not in text
    # The inputs are the whole rendering, prompts included.
    assert "Two times two?" in TOK.decode(row["inputs"].tolist())


def test_prompt_completion_pairs_train_on_the_completion(tmp_path):
    fmt = load_chat_format("prompt_completion", "", "")
    pairs = [
        {"prompt": "Capital of France?", "completion": "Paris."},
        {
            "prompt": [
                {"role": "system", "content": "One word."},
                {"role": "user", "content": "Colour of snow?"},
            ],
            "completion": [{"role": "assistant", "content": "White."}],
        },
    ]
    _prepare(_write(tmp_path / "src", pairs), tmp_path / "store", fmt)
    corpus = open_corpus(str(tmp_path / "store"), TOK)
    row = read_row(corpus, 0, corpus.num_tokens - 1)
    assert TOK.decode(row["labels"][row["labels"] != IGNORE_INDEX].tolist()) == (
        "Paris.<|im_end|>\nWhite.<|im_end|>\n"
    )


# A template that lists the record's `tools` (as Qwen3's does in its system turn).
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}{%- for t in tools %}"
    "{{ t.function.name + '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_parquet_conversations_give_the_store_jsonl_gives_tools_included(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tool = {"type": "function", "function": {"name": "get_weather"}}
    records = [{**c, "tools": [tool]} for c in CONVERSATIONS]
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    fmt = load_chat_format("messages", str(template), "")
    _prepare(_write(tmp_path / "jsonl", records), tmp_path / "from_jsonl", fmt)
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "parquet" / "chat.parquet")
    prepare_store(
        dataset="parquet",
        dataset_path=str(tmp_path / "parquet"),
        text_field="text",
        tokenizer=TOK,
        output=str(tmp_path / "from_parquet"),
        chat=fmt,
    )
    want, got = (open_corpus(str(tmp_path / s), TOK) for s in ("from_jsonl", "from_parquet"))
    assert got.num_tokens == want.num_tokens
    rows = [read_row(c, 0, c.num_tokens - 1) for c in (want, got)]
    assert "get_weather" in TOK.decode(rows[1]["inputs"].tolist())  # the tools column is read
    for k in ("inputs", "labels"):
        np.testing.assert_array_equal(rows[1][k], rows[0][k])


def test_windows_with_document_masks_keep_the_loss_mask(tmp_path):
    _prepare(_write(tmp_path / "src", CONVERSATIONS * 20), tmp_path / "store")
    corpus = open_corpus(str(tmp_path / "store"), TOK)
    ids, mask = encode_record("test", CONVERSATIONS[0], CHAT, TOK)
    per_conversation = int(mask.sum())
    stream = WindowStream(
        [Source("chat", corpus)],
        seq_len=32,
        global_batch_size=4,
        seed=0,
        document_mask=True,
        document_positions=True,
    )
    batch = next(stream)
    assert batch["inputs"].shape == (4, 32, 3)
    labels, tokens = batch["labels"], batch["inputs"][..., 0]
    # A label is trained only where the store's mask says so (checked against the corpus).
    _, windows = stream.window_index(np.arange(4))
    for r, w in enumerate(windows):
        expected = corpus.read_mask(int(w) * 32 + 1, int(w) * 32 + 33)
        assert np.array_equal(labels[r] != IGNORE_INDEX, expected), r
    assert (labels != IGNORE_INDEX).sum() < tokens.size  # prompts are not trained on
    assert TOK.decode(ids[mask].tolist()) == f"{REPLIES[0]}<|im_end|>\n{REPLIES[1]}<|im_end|>\n"
    assert per_conversation < len(ids)
    held_out = next(ValidationWindows(corpus, seq_len=32, global_batch_size=2).batches(1))
    assert np.array_equal(held_out["labels"][0] != IGNORE_INDEX, corpus.read_mask(1, 33))


@pytest.mark.parametrize(
    "record,message",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant"),
        (
            {
                "messages": [
                    {"role": "robot", "content": "hi"},
                    {"role": "assistant", "content": "hi"},
                ]
            },
            "robot",
        ),
        ({"messages": []}, "empty"),
    ],
)
def test_a_bad_conversation_is_one_line_naming_its_line_and_nothing_is_written(
    tmp_path, record, message
):
    src = _write(tmp_path / "src", [CONVERSATIONS[0], record])
    with pytest.raises(DataError, match=message) as e:
        _prepare(src, tmp_path / "store", keep_partial=False)
    assert "chat.jsonl:2" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_damaged_loss_mask_is_refused(tmp_path):
    _prepare(_write(tmp_path / "src", CONVERSATIONS), tmp_path / "store")
    mask = tmp_path / "store" / "mask-00000.bin"
    mask.write_bytes(mask.read_bytes()[:-1])
    with pytest.raises(StoreError, match="mask-00000.bin is corrupted"):
        open_corpus(str(tmp_path / "store"), TOK)


def test_another_template_is_another_store(tmp_path):
    src = _write(tmp_path / "src", CONVERSATIONS)
    _prepare(src, tmp_path / "store")
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    fmt = load_chat_format("messages", str(other), "")
    with pytest.raises(StoreError, match="other inputs"):
        _prepare(src, tmp_path / "store", fmt)


def test_the_shipped_chat_set_prepares_with_the_shipped_template(tmp_path):
    manifest = prepare_store(
        dataset="jsonl",
        dataset_path="titan_jax/data/assets/pydoc_chat_validation.jsonl",
        text_field="text",
        tokenizer=TOK,
        output=str(tmp_path / "store"),
        chat=CHAT,
    )
    assert manifest["documents"] == 8 and read_manifest(str(tmp_path / "store"))["loss_mask"]
    corpus = open_corpus(str(tmp_path / "store"), TOK)
    share = corpus.read_mask(0, corpus.num_tokens).mean()
    assert 0.3 < share < 0.95, share  # the replies are most of the text, not all of it
