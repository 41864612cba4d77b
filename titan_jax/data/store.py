"""The token store: a corpus tokenized once, read by training as fixed windows at O(1) cost.

A store is a folder (local or an fsspec URL) holding, per input file i of its source:
  tokens-{i:05d}.bin   the file's documents' tokens, each document followed by EOS, as raw
                       little-endian uint16 (vocabularies up to 65,536 ids) or uint32;
  docs-{i:05d}.bin     int64 end offset (exclusive, in the shard's tokens) of each document;
  mask-{i:05d}.bin     (stores of conversations, `loss_mask` in the manifest) one byte per
                       token: 1 where the token is trained on as a label (an assistant's), 0
                       where it is only read (prompts, role headers, the EOS between documents);
A store of preference pairs (`pairs` in the manifest, version 3) holds each pair as two
documents, prompt + chosen then prompt + rejected, never split across shards;
and `manifest.json`: the tokenizer's sha256, vocab size and EOS id, the source, token and
document counts, and every shard's sha256. The manifest is written last: a folder without one is
not a store. Shards are named by their input file's index in the source's sorted file list, so
stores prepared by several machines (`--num-shards N --shard-index I`, one store each) read
back, together, as the same token sequence as one store of all files.

`open_corpus` reads one or several stores as one token sequence: stores of the same source
(parts of one multi-machine prepare) merge by input file index, other stores follow in the
order given. Local shards are memory-mapped; remote ones are read by byte range.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from titan_jax.data.paths import filesystem, glob_dirs, is_local, join
from titan_jax.data.tokenizer import Tokenizer
from titan_jax.errors import TitanJaxError

FORMAT = "titan-jax-token-store"
# Version 2 stores carry a loss mask: a reader of version 1 only would train on their prompts,
# so it refuses them. Plain token stores stay version 1, readable by every titan-jax. Version 3
# stores hold preference pairs (and a loss mask): read as windows, they would train on the
# rejected completions, so readers of versions 1 and 2 refuse them.
VERSION, MASKED_VERSION, PAIRS_VERSION = 1, 2, 3
VERSIONS = (VERSION, MASKED_VERSION, PAIRS_VERSION)
MANIFEST = "manifest.json"


class StoreError(TitanJaxError, ValueError):
    """A token store that cannot be used: the message names the store or shard and the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_names(file_index: int) -> tuple[str, str]:
    return f"tokens-{file_index:05d}.bin", f"docs-{file_index:05d}.bin"


def mask_name(file_index: int) -> str:
    return f"mask-{file_index:05d}.bin"


def read_manifest(store: str) -> dict[str, Any] | None:
    """The store's manifest, every field checked (a cut or edited file is one StoreError naming
    it), or None where the folder has none (not a store, or one still being written)."""
    url = join(store, MANIFEST)
    fs, path = filesystem(url)
    if not fs.isfile(path):
        return None
    try:
        with fs.open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{url} is damaged (not JSON: {e}); prepare the store again") from None
    except OSError as e:
        raise StoreError(f"{url} cannot be read: {e.strerror or e}") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or manifest.get("version") not in VERSIONS
    ):
        raise StoreError(
            f"{url} is not a version {', '.join(map(str, VERSIONS))} titan-jax token store"
        )
    problem = _manifest_problem(manifest)
    if problem:
        raise StoreError(f"{url} is damaged ({problem}); prepare the store again")
    return manifest


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _manifest_problem(m: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields, or None."""
    if m.get("dtype") not in ("<u2", "<u4"):
        return f"dtype={m.get('dtype')!r}"
    tok, source, shards = m.get("tokenizer"), m.get("source"), m.get("shards")
    if not (
        isinstance(tok, dict)
        and isinstance(tok.get("sha256"), str)
        and type(tok.get("vocab_size")) is int
        and tok["vocab_size"] >= 1
        and type(tok.get("eos_id")) is int
        and 0 <= tok["eos_id"] < tok["vocab_size"]
    ):
        return f"tokenizer={tok!r}"
    if np.dtype(m["dtype"]) != token_dtype(tok["vocab_size"]):
        return f"dtype={m['dtype']!r} for vocab_size={tok['vocab_size']}"
    if not (
        isinstance(source, dict)
        and isinstance(source.get("inputs_sha256"), str)
        and type(source.get("files")) is int
        and source["files"] >= 1
    ):
        return f"source={source!r}"
    if not isinstance(shards, list) or not shards:
        return "no shards"
    masked, pairs = m["version"] in (MASKED_VERSION, PAIRS_VERSION), m["version"] == PAIRS_VERSION
    if m.get("loss_mask", False) is not masked:
        return f"loss_mask={m.get('loss_mask')!r} in a version {m['version']} store"
    if m.get("pairs", False) is not pairs:
        return f"pairs={m.get('pairs')!r} in a version {m['version']} store"
    digests = ("tokens_sha256", "docs_sha256", *(("mask_sha256",) if masked else ()))
    for entry in shards:
        if not (
            isinstance(entry, dict)
            and _is_count(entry.get("file_index"))
            and entry["file_index"] < source["files"]
            and _is_count(entry.get("tokens"))
            and _is_count(entry.get("documents"))
            and all(isinstance(entry.get(k), str) for k in digests)
        ):
            return f"shard entry {entry!r}"[:200]
        if pairs and entry["documents"] % 2:
            return f"shard {entry['file_index']} holds {entry['documents']} documents: not pairs"
    for key in ("tokens", "documents"):
        if m.get(key) != sum(e[key] for e in shards):
            return f"{key}={m.get(key)!r} is not the sum of its shards'"
    return None


@dataclass
class Shard:
    """One input file's tokens in one store; `local`: memory-mapped, else read by range."""

    store: str
    entry: dict[str, Any]  # the manifest's record of it
    dtype: np.dtype
    vocab_size: int  # the run's tokenizer's (the store's, by its sha256): every id is below

    def __post_init__(self) -> None:
        tokens, docs = shard_names(self.entry["file_index"])
        self.tokens_url, self.docs_url = join(self.store, tokens), join(self.store, docs)
        self.mask_url = (
            join(self.store, mask_name(self.entry["file_index"]))
            if "mask_sha256" in self.entry
            else None
        )
        self.num_tokens = int(self.entry["tokens"])
        self.local = is_local(self.tokens_url)
        self._tokens: Any = None
        self._docs: np.ndarray | None = None
        self._mask: Any = None

    def _files(self) -> list[tuple[str, int, str]]:
        """(url, size in bytes, manifest digest key) of each of the shard's files."""
        files = [
            (self.tokens_url, self.num_tokens * self.dtype.itemsize, "tokens_sha256"),
            (self.docs_url, int(self.entry["documents"]) * 8, "docs_sha256"),
        ]
        if self.mask_url is not None:
            files.append((self.mask_url, self.num_tokens, "mask_sha256"))
        return files

    def check_sizes(self) -> None:
        for url, size, _ in self._files():
            fs, path = filesystem(url)
            if not fs.isfile(path):
                raise StoreError(f"shard {url} is missing; prepare the store again")
            if fs.size(path) != size:
                raise StoreError(
                    f"shard {url} is corrupted: {fs.size(path)} bytes, the manifest "
                    f"says {size}; prepare the store again"
                )

    def verify(self) -> None:
        """Every byte against the manifest's checksums (reads the whole shard)."""
        self.check_sizes()
        for url, _, key in self._files():
            fs, path = filesystem(url)
            digest = hashlib.sha256()
            with fs.open(path, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
            if digest.hexdigest() != self.entry[key]:
                raise StoreError(
                    f"shard {url} is corrupted (sha256 differs from the manifest); "
                    "prepare the store again"
                )
        for start in range(0, self.num_tokens, 1 << 24):  # ids, a block at a time
            self.read(start, min(start + (1 << 24), self.num_tokens))
        ends = np.asarray(self.document_ends())
        if ends.size and (
            np.any(np.diff(ends) <= 0) or ends[0] <= 0 or ends[-1] != self.num_tokens
        ):
            raise StoreError(
                f"shard {self.docs_url} is corrupted (its document ends are not "
                f"increasing up to {self.num_tokens} tokens); prepare the store "
                "again"
            )

    def _check_ids(self, tokens: np.ndarray, start: int) -> None:
        """A token id past the vocabulary would index past the embedding (in XLA: a silent
        clamp, or NaNs several steps later): named here, with its store."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            at = start + int(np.argmax(tokens >= self.vocab_size))
            raise StoreError(
                f"shard {self.tokens_url} is corrupted: token {at} is id "
                f"{int(tokens[at - start])}, past the tokenizer's vocab_size "
                f"{self.vocab_size}; prepare the store again"
            )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of this shard (each id checked against the vocabulary)."""
        if self.local:
            if self._tokens is None:
                self._tokens = np.memmap(filesystem(self.tokens_url)[1], self.dtype, mode="r")
            tokens = self._tokens[start:stop]
        else:
            if self._tokens is None:  # checked at first use: a request per file, not per window
                self.check_sizes()
                self._tokens = filesystem(self.tokens_url)
            fs, path = self._tokens
            size = self.dtype.itemsize
            tokens = np.frombuffer(
                fs.cat_file(path, start=start * size, end=stop * size), self.dtype
            )
        self._check_ids(tokens, start)
        return tokens

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask of tokens [start, stop) (all ones where the shard has none)."""
        if self.mask_url is None:
            return np.ones(stop - start, np.uint8)
        if self._mask is None:
            fs, path = filesystem(self.mask_url)
            self._mask = np.memmap(path, np.uint8, mode="r") if self.local else (fs, path)
        if self.local:
            return np.asarray(self._mask[start:stop])
        fs, path = self._mask
        return np.frombuffer(fs.cat_file(path, start=start, end=stop), np.uint8)

    def document_ends(self) -> np.ndarray:
        if self._docs is None:
            fs, path = filesystem(self.docs_url)
            if self.local:
                self._docs = np.memmap(path, np.int64, mode="r")
            else:  # 8 bytes a document: read once
                self._docs = np.frombuffer(fs.cat_file(path), np.int64)
        return self._docs


class Corpus:
    """Several stores' shards as one token sequence (`pairs`: their documents are preference
    pairs, two by two)."""

    def __init__(self, shards: Sequence[Shard], pairs: bool = False):
        self.shards, self.pairs = list(shards), pairs
        # What the corpus holds, not where: a store copied or moved elsewhere is the same.
        self.content_sha256 = hashlib.sha256(
            "".join(s.entry["tokens_sha256"] for s in self.shards).encode()
        ).hexdigest()
        sizes = np.array([s.num_tokens for s in self.shards], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self.starts[-1])
        counts = np.array([s.entry["documents"] for s in self.shards], np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(counts)])  # first document per shard
        self.num_documents = int(self.doc_starts[-1])
        # Some tokens are prompts, not labels (conversations): windows ignore their labels.
        self.has_loss_mask = any(s.mask_url is not None for s in self.shards)

    def _gather(self, start: int, stop: int, dtype: type, read: Any) -> np.ndarray:
        """`read(shard, begin, end)` over the shards that tokens [start, stop) span."""
        out = np.empty(stop - start, dtype)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            begin, end = int(self.starts[i]), int(self.starts[i + 1])
            take = min(stop, end)
            out[pos - start : take - start] = read(self.shards[i], pos - begin, take - begin)
            pos, i = take, i + 1
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int32."""
        return self._gather(start, stop, np.int32, Shard.read)

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask of tokens [start, stop): True where a token is trained on as a label."""
        return self._gather(start, stop, np.uint8, Shard.read_mask).astype(bool)

    def document_ends(self, start: int, stop: int) -> np.ndarray:
        """Positions in (start, stop] where a document ends (exclusive end offsets)."""
        found = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while i < len(self.shards) and self.starts[i] < stop:
            begin = int(self.starts[i])
            ends = self.shards[i].document_ends()
            lo, hi = np.searchsorted(ends, [start - begin, stop - begin], side="right")
            found.append(np.asarray(ends[lo:hi]) + begin)
            i += 1
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def document_lengths(self) -> np.ndarray:
        """Tokens of every document in order, its EOS included (reads every shard's offsets)."""
        ends = [
            np.asarray(shard.document_ends()) + begin
            for shard, begin in zip(self.shards, self.starts[:-1].tolist(), strict=True)
        ]
        return np.diff(np.concatenate([np.zeros(1, np.int64), *ends]))

    def document(self, j: int) -> tuple[int, int]:
        """Token range [start, stop) of document `j` (its EOS included)."""
        i = int(np.searchsorted(self.doc_starts, j, side="right")) - 1
        ends, local = self.shards[i].document_ends(), j - int(self.doc_starts[i])
        begin = int(self.starts[i])
        return begin + (int(ends[local - 1]) if local else 0), begin + int(ends[local])

    def verify(self) -> None:
        for shard in self.shards:
            shard.verify()


def open_corpus(
    spec: str, tokenizer: Tokenizer, *, what: str = "training.dataset_path", pairs: bool = False
) -> Corpus:
    """The stores named by `spec` (folders, comma-separated, globs allowed) as one corpus, after
    checking their tokenizer and their shard files' sizes, and that they hold preference
    pairs when (and only when) `pairs` is asked for."""
    stores = glob_dirs(spec)
    if not stores:
        raise StoreError(f"{what}={spec!r} names no token store folder")
    groups: dict[str, list[Shard]] = {}
    files: dict[str, int] = {}
    for store in stores:
        manifest = read_manifest(store)
        if manifest is None:
            hint = (
                "write one with `titan-jax prepare-data --config ... --output "
                f"{shlex.quote(store)}`"
            )
            if store.startswith("memory://"):  # another process's memory: prepare-data cannot
                hint = "a memory:// store lives in the process that wrote it; use a folder"
            raise StoreError(f"{what}: {store} is not a token store (no {MANIFEST}); {hint}")
        _check_tokenizer(store, manifest["tokenizer"], tokenizer)
        if manifest.get("pairs", False) != pairs:
            raise StoreError(
                f"{what}: {store} holds preference pairs; train on it with "
                "training.data_format='preference' and [dpo]"
                if not pairs
                else f"{what}: {store} holds no preference pairs; prepare the pairs with "
                "training.data_format='preference'"
            )
        source = manifest["source"]
        files[source["inputs_sha256"]] = source["files"]
        dtype = np.dtype(manifest["dtype"])
        groups.setdefault(source["inputs_sha256"], []).extend(
            Shard(store, e, dtype, tokenizer.vocab_size) for e in manifest["shards"]
        )
    shards = []
    for key, group in groups.items():
        group.sort(key=lambda s: s.entry["file_index"])
        indices = [s.entry["file_index"] for s in group]
        if len(set(indices)) != len(indices):
            dup = sorted({i for i in indices if indices.count(i) > 1})
            raise StoreError(
                f"{what}={spec!r}: input files {dup[:8]} appear in two stores "
                "(the same part prepared twice?)"
            )
        missing = sorted(set(range(files[key])) - set(indices))
        if missing:
            raise StoreError(
                f"{what}={spec!r}: the stores of {group[0].store} lack input files "
                f"{missing[:8]} of {files[key]} (a --shard-index not prepared yet?)"
            )
        shards.extend(group)
    for shard in shards:  # remote shards: at their first read (thousands of requests otherwise)
        if shard.local:
            shard.check_sizes()
    corpus = Corpus(shards, pairs)
    if corpus.num_tokens < 2:
        raise StoreError(f"{what}={spec!r} holds {corpus.num_tokens} tokens")
    return corpus


def _check_tokenizer(store: str, recorded: dict[str, Any], tokenizer: Tokenizer) -> None:
    if recorded["sha256"] != tokenizer.sha256:
        raise StoreError(
            f"token store {store} was made with tokenizer {recorded['path'] or '(shipped)'} "
            f"(sha256 {recorded['sha256'][:12]}), not this run's {tokenizer.where or '(shipped)'}"
            f" (sha256 {tokenizer.sha256[:12]}); prepare it again with this model.tokenizer_path"
        )
