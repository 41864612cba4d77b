"""A keyed bijection of [0, n) evaluated index by index in O(1) memory: the epoch order of a
corpus of any size without materialising a permutation of its windows.

A balanced Feistel network (4 rounds of a splitmix64 mixer) permutes the smallest domain of
4**h >= n indices; cycle walking (apply it again until the result falls below n) restricts it to
[0, n). Each Feistel round is invertible, so the whole map is a bijection for every key; fewer
than 4 walks are expected per index (the domain is < 4n). grain's `index_shuffle` does the same
job but grain is not installed here; this is ~40 lines of numpy, vectorised over indices.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective avalanche of uint64 (multiplications wrap)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int) -> int:
    """One 64-bit key from integers (seed, source, epoch, ...)."""
    key = np.zeros(1, np.uint64)
    for p in parts:
        key = _mix(key ^ np.array([p], np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return int(key[0])


class Permutation:
    """`p(i)` for an int array `i` of values in [0, n): a permutation of [0, n) fixed by `key`."""

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self._half = max(0, (int(n - 1).bit_length() + 1) // 2)  # bits per half: 4**h >= n
        self._mask = np.uint64((1 << self._half) - 1)
        self._keys = _mix(np.arange(_ROUNDS, dtype=np.uint64) + np.uint64(key))

    def _round(self, r: int, x: np.ndarray) -> np.ndarray:
        return _mix(x ^ self._keys[r]) & self._mask

    def _feistel(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        h = np.uint64(self._half)
        left, right = x >> h, x & self._mask
        for r in reversed(range(_ROUNDS)) if inverse else range(_ROUNDS):
            if inverse:
                left, right = right ^ self._round(r, left), left
            else:
                left, right = right, left ^ self._round(r, right)
        return (left << h) | right

    def _walk(self, i: np.ndarray, inverse: bool) -> np.ndarray:
        x = np.asarray(i, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"indices must lie in [0, {self.n})")
        x = x.astype(np.uint64)
        todo = np.ones(x.shape, bool)
        while todo.any():  # cycle walking: ends, since the Feistel map permutes its domain
            x[todo] = self._feistel(x[todo], inverse)
            todo = x >= np.uint64(self.n)
        return x.astype(np.int64)

    def __call__(self, i: np.ndarray | int) -> np.ndarray:
        return self._walk(np.atleast_1d(i), inverse=False)

    def inverse(self, j: np.ndarray | int) -> np.ndarray:
        return self._walk(np.atleast_1d(j), inverse=True)
