"""Random preference pairs and their titan-jax rows, for the DPO tests."""

import numpy as np

from titan_jax.data.pairs import pair_row


def random_pairs(n, vocab_size, seed=0):
    """(prompt + chosen, prompt + rejected) ids and completion masks of `n` pairs of different
    lengths (random ids below `vocab_size`): 7 to 21 tokens a sequence."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        prompt = rng.integers(0, vocab_size, rng.integers(3, 8))
        pair = []
        for _ in range(2):
            completion = rng.integers(0, vocab_size, rng.integers(4, 14))
            pair.append(
                (
                    np.concatenate([prompt, completion]),
                    np.r_[np.zeros(len(prompt), bool), np.ones(len(completion), bool)],
                )
            )
        pairs.append(pair)
    return pairs


def pair_batch(pairs, seq_len):
    """The pairs as a batch of rows of `seq_len` tokens, one pair a row."""
    rows = [pair_row(pair, seq_len) for pair in pairs]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
