"""Build the shipped chat set: conversations about CPython's help topics, for SFT on CPU.

Each of `pydoc_data.topics.topics` (sorted by name) becomes one conversation: a system prompt, a
question naming the topic's title, its first paragraphs as the assistant's replies, and "Go
on." between them. Every 10th topic is held out (the same split as the `pydoc` dataset), so
the validation conversations are about topics training never sees. Written once and committed
(the topics' text changes between Python versions), as scripts/build_tokenizer.py.

    python scripts/build_chat_set.py [--out titan_jax/data/assets]
"""

import argparse
import json
import re
from pathlib import Path
from pydoc_data.topics import topics

HELD_OUT_EVERY = 10  # titan_jax/data/dataset.py's PYDOC_HELD_OUT_EVERY
TURNS = 3  # assistant replies per conversation at most
REPLY_CHARS = 700  # a reply's paragraphs up to about this many characters
SYSTEM = "You answer questions about the Python language reference, briefly."
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "titan_jax/data/assets"


def conversation(text: str) -> dict:
    lines = text.strip().splitlines()
    title, body = lines[0].strip(), "\n".join(lines[2:])  # the title, its underline
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body) if p.strip()]
    replies: list[str] = []
    for paragraph in paragraphs:
        if replies and len(replies[-1]) + len(paragraph) < REPLY_CHARS:
            replies[-1] += "\n\n" + paragraph
        elif len(replies) < TURNS:
            replies.append(paragraph)
        else:
            break
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What does the reference say about {title}?"},
    ]
    for i, reply in enumerate(replies):
        if i:
            messages.append({"role": "user", "content": "Go on."})
        messages.append({"role": "assistant", "content": reply})
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args().out
    texts = [topics[k] for k in sorted(topics)]
    held_out = texts[::HELD_OUT_EVERY]
    splits = {"train": [t for t in texts if t not in set(held_out)], "validation": held_out}
    for split, chosen in splits.items():
        path = out / f"pydoc_chat_{split}.jsonl"
        path.write_text(
            "".join(json.dumps(conversation(t), ensure_ascii=False) + "\n" for t in chosen),
            encoding="utf-8",
        )
        print(f"{path}: {len(chosen)} conversations")


if __name__ == "__main__":
    main()
