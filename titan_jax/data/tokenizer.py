"""A thin wrapper over a HF `tokenizers` tokenizer.json: ids in, ids out, plus EOS/BOS ids.

`load_tokenizer("")` gives the shipped 2048-token BPE (built by scripts/build_tokenizer.py);
a path to a tokenizer.json, or a directory holding one (e.g. a Qwen3 HF checkout), loads the same
way. EOS comes from `eos_token` (or `eos_token_id`) in a tokenizer_config.json next to the
file, else from a well-known special-token name; BOS likewise. Every id the config gives for
them must be the one tokenizer.json has.
"""

import hashlib
import json
from importlib import resources
from pathlib import Path

import tokenizers

from titan_jax.errors import TitanJaxError

EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "</s>", "<|end_of_text|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>")


class TokenizerError(TitanJaxError, ValueError):
    """A tokenizer that cannot be loaded: the message names the file and what is wrong."""


class Tokenizer:
    """Text <-> token ids; `vocab_size` bounds every id (the embedding needs that many rows)."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        eos_id: int,
        bos_id: int | None = None,
        where: str = "",
        sha256: str = "",
    ):
        self._tok = tok
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.where = where  # the file it was loaded from, for messages
        # Of the tokenizer.json text and the EOS id: what a token store records to refuse
        # another tokenizer's tokens.
        self.sha256 = sha256 or hashlib.sha256(f"{tok.to_str()}\0{eos_id}".encode()).hexdigest()
        # Max id + 1 rather than a token count: ids need not be contiguous in a HF file.
        self.vocab_size: int = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS here: the data pipeline decides where document boundaries go.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, each token's [start, end) characters in `text`): how data/chat.py maps the
        spans it trains on to tokens."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once (the Rust side spreads them over its threads)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def to_json(self) -> str:
        """The tokenizer.json text: how worker processes rebuild it (`from_json_text`)."""
        return self._tok.to_str()

    def decode(self, ids: list[int]) -> str:
        # Keep special tokens so document boundaries stay visible in decoded samples.
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: str = "") -> Tokenizer:
    """Loads the shipped tokenizer (`path=""`), a tokenizer.json file, or a directory with one."""
    if not path:
        asset = resources.files("titan_jax.data") / "assets" / "tokenizer.json"
        return _from_json(asset.read_text(encoding="utf-8"), where=str(asset), config={})
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise TokenizerError(f"tokenizer path {path!r}: no tokenizer.json file at {str(file)!r}")
    config_file = file.parent / "tokenizer_config.json"
    config = _read_config(config_file)
    return _from_json(
        _read_text(file), where=str(file), config=config, config_where=str(config_file)
    )


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(
            f"tokenizer file {str(file)!r} is not UTF-8 text (byte {e.start}); "
            "tokenizer.json files are UTF-8 JSON"
        ) from None
    except OSError as e:
        raise TokenizerError(
            f"tokenizer file {str(file)!r} cannot be read: {e.strerror or e}"
        ) from None


def _read_config(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        config = json.loads(_read_text(file))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"tokenizer config {str(file)!r} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise TokenizerError(f"tokenizer config {str(file)!r} is not a JSON object")
    return config


def _shown(value: object) -> str:
    """A config value as JSON, cut short (a number of a million digits included)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:40]}..."


def special_token(config: dict, field: str, where: str) -> str | None:
    """The special token `field` (`eos_token`, ...) of tokenizer_config.json `where`: HF stores
    one as a string or as {"content": "...", ...}; None when absent or null."""
    value = config.get(field)
    content = value.get("content") if isinstance(value, dict) else value
    if isinstance(content, str) or value is None:
        return content
    raise TokenizerError(
        f"tokenizer config {where!r}: {field}={_shown(value)} is not a token; give the token's "
        f'text (e.g. "<|im_end|>", or {{"content": "<|im_end|>"}}), or null'
    )


def _special_id(tok: tokenizers.Tokenizer, config: dict, name: str, where: str) -> int | None:
    """The id of special token `name` ("eos" or "bos") that tokenizer_config.json `where` sets
    by `{name}_token` or `{name}_token_id` (None if neither), checked against the tokenizer: an
    id it does not have, or two ids for one token, would train on a token nobody asked for."""
    field = f"{name}_token"
    token = special_token(config, field, where)
    token_id = None if token is None else tok.token_to_id(token)
    if token is not None and token_id is None:
        raise TokenizerError(
            f"tokenizer config {where!r}: {field}={token!r} is not in the vocab "
            "of the tokenizer.json beside it"
        )
    given = config.get(f"{field}_id")
    if given is not None:
        vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        if not (
            type(given) is int and 0 <= given < vocab_size and tok.id_to_token(given) is not None
        ):
            raise TokenizerError(
                f"tokenizer config {where!r}: {field}_id={_shown(given)} is not a token id of "
                f"the tokenizer.json beside it (0 to {vocab_size - 1}); give the id of "
                f"{name.upper()}, or leave {field}_id out"
            )
        if token_id is not None and given != token_id:
            raise TokenizerError(
                f"tokenizer config {where!r}: {field}_id={given}, but {field}={token!r} is id "
                f"{token_id}; make them agree, or leave {field}_id out"
            )
        token_id = given
    decoder = config.get("added_tokens_decoder")
    if token_id is not None and isinstance(decoder, dict):
        content = tok.id_to_token(token_id)
        for key, entry in decoder.items():
            if isinstance(entry, dict) and entry.get("content") == content and key != str(token_id):
                raise TokenizerError(
                    f"tokenizer config {where!r}: added_tokens_decoder gives {content!r} "
                    f"({field}) the id {_shown(key)}, but tokenizer.json has it at {token_id}; "
                    "make the two files agree"
                )
    return token_id


def _from_json(text: str, *, where: str, config: dict, config_where: str = "") -> Tokenizer:
    """`config`: the tokenizer_config.json beside the file (`config_where`), or {}."""
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises bare Exception on malformed files
        raise TokenizerError(f"tokenizer file {where!r} is not a valid tokenizer.json: {e}") from e

    eos_id = _special_id(tok, config, "eos", config_where)
    if eos_id is None:
        eos_id = next((i for n in EOS_NAMES if (i := tok.token_to_id(n)) is not None), None)
    if eos_id is None:
        raise TokenizerError(
            f"tokenizer {where!r} has no EOS token: set eos_token in tokenizer_config.json "
            f"or include one of {list(EOS_NAMES)}"
        )
    bos_id = _special_id(tok, config, "bos", config_where)
    if bos_id is None and "bos_token" not in config:  # an explicit null means "no BOS" (Qwen3)
        bos_id = next((i for n in BOS_NAMES if (i := tok.token_to_id(n)) is not None), None)
    sha256 = hashlib.sha256(f"{text}\0{eos_id}".encode()).hexdigest()
    return Tokenizer(tok, eos_id=eos_id, bos_id=bos_id, where=where, sha256=sha256)
