"""Train the shipped 2048-token byte-level BPE tokenizer on CPython's own help text.

The corpus is `pydoc_data.topics.topics` (one document per topic, sorted by topic name), so the
build needs no download. Same Python version -> byte-identical tokenizer.json.

    python scripts/build_tokenizer.py [--out titan_jax/data/assets/tokenizer.json]
"""

import argparse
from pathlib import Path
from pydoc_data.topics import topics

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

VOCAB_SIZE = 2048
# Special tokens get the first ids, so EOS is id 0 whatever the corpus.
SPECIAL_TOKENS = ["<|endoftext|>"]
# Qwen2/Qwen3's pre-tokenizer split: single digits, letters with one leading non-letter,
# punctuation runs, newline runs.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "titan_jax/data/assets/tokenizer.json"


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any UTF-8 text encodes without unknown tokens.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args().out
    out.parent.mkdir(parents=True, exist_ok=True)
    build().save(str(out), pretty=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
