"""Build the shipped preference set: pairs from the shipped chat set, for DPO on CPU.

Every assistant reply of `pydoc_chat_{train,validation}.jsonl` (scripts/build_chat_set.py)
becomes one pair in TRL's conversational preference form: `prompt` one user message (the
conversation's question for its first reply, a request for more on the same topic for the
others), `chosen` the reply (its first REPLY_CHARS characters, cut at a word), `rejected` the
same words in a shuffled order (seeded by the pair's index: deterministic). Short, so a pair
fits a row of 192 tokens of the shipped tokenizer. Fluent text over
the same words in a random order is a preference a small model can learn, and one that holds
on the held-out topics too (the validation pairs come from the held-out conversations).

    python scripts/build_preference_set.py [--assets titan_jax/data/assets]
"""

import argparse
import json
import random
from pathlib import Path

REPLY_CHARS = 100
DEFAULT_ASSETS = Path(__file__).resolve().parents[1] / "titan_jax/data/assets"


def shortened(text: str) -> str:
    words, out = " ".join(text.split()).split(" "), []
    for word in words:
        if out and len(" ".join([*out, word])) > REPLY_CHARS:
            break
        out.append(word)
    return " ".join(out)


def pairs(conversation: dict, first_index: int) -> list[dict]:
    messages, out = conversation["messages"], []
    question = next(m["content"] for m in messages if m["role"] == "user")
    topic = question.removeprefix("What does the reference say about ").removesuffix("?")
    for message in messages:
        if message["role"] != "assistant":
            continue
        ask = question if not out else f"What more does it say about {topic}?"
        chosen = shortened(message["content"])
        words = chosen.split(" ")
        random.Random(first_index + len(out)).shuffle(words)
        if words == chosen.split(" "):  # one word, or a shuffle that changed nothing
            continue
        out.append(
            {
                "prompt": [{"role": "user", "content": ask}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": " ".join(words)}],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=DEFAULT_ASSETS)
    assets = parser.parse_args().assets
    for split in ("train", "validation"):
        records: list[dict] = []
        lines = (assets / f"pydoc_chat_{split}.jsonl").read_text(encoding="utf-8").splitlines()
        for line in lines:
            records += pairs(json.loads(line), len(records))
        path = assets / f"pydoc_preference_{split}.jsonl"
        path.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8"
        )
        print(f"{path}: {len(records)} pairs")


if __name__ == "__main__":
    main()
