"""Training-stream throughput (tokenize + pack) of `data/stream.py` on the embedded corpus.

`python benchmarks/bench_data.py`: tokens/s for all rows of a global batch of 8, and for one
process's 8 rows of a global batch of 64 (what each of 8 hosts reads): per-process cost follows
the rows a process holds, not the global batch.
"""

import argparse
import time

from titan_jax.data.stream import build_train_iterator
from titan_jax.data.tokenizer import load_tokenizer


def tokens_per_second(global_batch: int, rows: range | None, batches: int, seq_len: int) -> float:
    it = build_train_iterator(dataset="pydoc", dataset_path="", text_field="text",
                              tokenizer=load_tokenizer(""), seq_len=seq_len,
                              global_batch_size=global_batch, seed=0, rows=rows)
    next(it)  # the first batch reads the corpus
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(it)
    return batches * batch["inputs"].size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=20)
    a = parser.parse_args()
    for label, global_batch, rows in (("all 8 rows of 8", 8, None),
                                      ("8 rows of 64 (one of 8 hosts)", 64, range(8)),
                                      ("all 64 rows of 64", 64, None)):
        rate = tokens_per_second(global_batch, rows, a.batches, a.seq_len)
        print(f"{label:32s} {rate:12,.0f} tokens/s")


if __name__ == "__main__":
    main()
