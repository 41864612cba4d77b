"""Conversations -> token ids and a loss mask: what a token store of SFT data holds.

A record is a conversation (`messages`, the HF/OpenAI chat form: a list of {role, content},
with `tools` beside it where the template lists them) or a prompt/completion pair (`prompt`
and `completion`: strings, or lists of messages as in TRL's conversational form). Each is
rendered with the checkpoint's own chat template (data/chat.py, as transformers'
`apply_chat_template` renders it) and tokenized whole; the assistant's tokens are the labels
trained on, everything else is context.

A preference pair (`prompt`, `chosen`, `rejected`, TRL's preference form; strings or lists of
messages) is two documents, in this order: prompt + chosen and prompt + rejected, each
rendered as a prompt/completion pair (data/pairs.py lays them out for DPO).

The template is `training.chat_template` (a .jinja file or a tokenizer_config.json) or, by
default, the tokenizer's own: the tokenizer_config.json beside `model.tokenizer_path`. The
shipped tokenizer has one (`assets/chat_template.jinja`, ChatML in plain text).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from titan_jax.data import chat
from titan_jax.data.dataset import DataError
from titan_jax.data.tokenizer import Tokenizer

# The record fields each format reads.
FORMATS = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
}
# The fields a format reads where a record has them (a parquet file is read for its columns).
OPTIONAL_FIELDS = {"messages": ("tools",)}


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How a source's records become conversations and tokens (picklable: prepare's worker
    processes get one)."""

    kind: str  # a key of FORMATS
    template: str  # the Jinja text
    source: str  # the file it was read from, for messages and the store's manifest
    # The template's eos_token, ... (chat.load_special_tokens); () = the tokenizer's EOS/BOS.
    special_tokens: tuple[tuple[str, str], ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return FORMATS[self.kind]

    @property
    def optional_fields(self) -> tuple[str, ...]:
        return OPTIONAL_FIELDS.get(self.kind, ())

    @property
    def sha256(self) -> str:
        what = json.dumps([self.template, list(self.special_tokens)])
        return hashlib.sha256(what.encode()).hexdigest()


def load_chat_format(kind: str, template_path: str, tokenizer_path: str) -> ChatFormat:
    """The format of `kind` with the template of `template_path` (a .jinja file, a
    tokenizer_config.json or a folder), else the tokenizer's own (`tokenizer_path`'s folder;
    "" = the shipped tokenizer's)."""
    if kind not in FORMATS:
        raise DataError(f"data format {kind!r} is not a conversation format: {', '.join(FORMATS)}")
    tokenizer_folder = Path(tokenizer_path)
    if tokenizer_folder.is_file():
        tokenizer_folder = tokenizer_folder.parent
    if not template_path and not tokenizer_path:
        asset = resources.files("titan_jax.data") / "assets" / "chat_template.jinja"
        template, source = asset.read_text(encoding="utf-8"), str(asset)
    else:
        source = template_path or str(tokenizer_folder)
        try:
            template = chat.load_chat_template(source)
        except chat.ChatError as e:
            raise DataError(str(e)) from None
    # The template's eos_token, ...: the tokenizer's (its EOS by default, see chat.py).
    special = chat.load_special_tokens(str(tokenizer_folder)) if tokenizer_path else {}
    return ChatFormat(kind, template, source, tuple(sorted(special.items())))


def encode_record(
    where: str, record: dict[str, Any], fmt: ChatFormat, tok: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one record; bad records raise one line naming `where`."""
    special = dict(fmt.special_tokens) or None
    try:
        if fmt.kind == "messages":
            return chat.render_with_mask(
                record["messages"],
                fmt.template,
                tok,
                tools=record.get("tools"),
                special_tokens=special,
                where=where,
            )
        return chat.render_pair(
            record["prompt"],
            record["completion"],
            fmt.template,
            tok,
            special_tokens=special,
            where=where,
        )
    except chat.ChatError as e:  # a damaged input, as prepare-data treats one
        raise DataError(str(e)) from None


def encode_pair(
    where: str, record: dict[str, Any], fmt: ChatFormat, tok: Tokenizer
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids, loss mask) of prompt + chosen and of prompt + rejected; a pair whose two
    render to the same tokens (it would teach nothing) raises one line naming `where`."""
    special = dict(fmt.special_tokens) or None
    try:
        pair = [
            chat.render_pair(
                record["prompt"],
                record[k],
                fmt.template,
                tok,
                special_tokens=special,
                where=where,
                completion_name=k,
            )
            for k in ("chosen", "rejected")
        ]
    except chat.ChatError as e:  # a damaged input, as prepare-data treats one
        raise DataError(str(e)) from None
    if np.array_equal(pair[0][0], pair[1][0]):
        raise DataError(
            f"{where}: chosen equals rejected; a preference pair needs two different completions"
        )
    return pair


def encode_documents(
    where: str, record: dict[str, Any], fmt: ChatFormat, tok: Tokenizer
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The documents (token ids, loss mask) one record becomes: a conversation is one, a
    preference pair two (`encode_pair`)."""
    if fmt.kind == "preference":
        return encode_pair(where, record, fmt, tok)
    return [encode_record(where, record, fmt, tok)]


def encode_conversations(
    records: list[Any], fmt: ChatFormat, tok: Tokenizer
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids and loss masks of the documents of (where, record) pairs, in order."""
    ids, masks = [], []
    for where, record in records:
        for x, m in encode_documents(where, record, fmt, tok):
            ids.append(x)
            masks.append(m)
    return ids, masks
