"""Context parallelism: each sequence split over the `cp` mesh axis, causally load-balanced.

A sequence of T tokens is cut into 2 x cp chunks of T / (2 cp); cp rank i holds chunks i and
2cp-1-i, so every rank has the same causal work (an early chunk, which attends to little, and a
late one, which attends to much). The batch is laid out in that order on the host
(`to_load_balanced`): contiguous T / cp blocks of the laid-out sequence are the ranks' shards,
so the batch's `seq` dim is simply sharded over `cp` and the data moves to its rank once.

Inside SimpleFSDP's shard_map (manual over the data axes, `cp` among them) each rank's forward
sees its T / cp tokens: RoPE reads their global positions (`positions`), and attention
all-gathers K and V over `cp` (`gather`; its transpose reduce-scatters their gradients), in the
laid-out order whose positions `gathered_positions` gives, and masks causally by position.
The loss is a sum over tokens, so the order changes nothing there.

All-gather rather than a ring: with GQA, K and V are small next to Q (Qwen3-8B at 32K: 8 kv
heads x 128 x 32,768 x bf16 = 64 MiB each per sequence and layer) and one gather per layer
overlaps with the Q projection; a ring would pass the same bytes in cp steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from titan_jax.config_schema import ConfigError

CP = "cp"


def load_balanced_order(seq_len: int, cp: int) -> np.ndarray:
    """The positions of a sequence in load-balanced layout order: rank i's chunks i and
    2cp-1-i, rank after rank."""
    chunk = seq_len // (2 * cp)
    order = [k for i in range(cp) for k in (i, 2 * cp - 1 - i)]
    return np.concatenate([np.arange(k * chunk, (k + 1) * chunk) for k in order])


def to_load_balanced(x_BT: np.ndarray, cp: int) -> np.ndarray:
    """A (rows, seq) host batch in load-balanced layout order (identity for cp 1)."""
    if cp == 1:
        return x_BT
    return x_BT[:, load_balanced_order(x_BT.shape[1], cp)]


def held_spans(held: slice, seq_len: int, cp: int) -> list[tuple[int, int]]:
    """The token ranges [a, b) of a row behind the layout-order positions `held` (what some
    devices hold), in layout order: the ranges a process reads to give exactly those."""
    positions = load_balanced_order(seq_len, cp)[held] if cp > 1 else np.arange(seq_len)[held]
    runs = np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)
    return [(int(run[0]), int(run[-1]) + 1) for run in runs]


def check_seq_len(seq_len: int, cp: int, field: str) -> None:
    """A sequence cp can split: 2 x cp chunks of equal length."""
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"{field}={seq_len} must be a multiple of 2 x parallelism."
            f"context_parallel_degree = {2 * cp} (each rank holds two equal "
            "chunks of every sequence)"
        )


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The `SequenceSplit` hook over the manual mesh axis `axis` (inside shard_map)."""

    degree: int
    method: str = "allgather"
    axis: str = CP

    def chunks(self) -> jax.Array:
        rank = lax.axis_index(self.axis)
        return jnp.stack([rank, 2 * self.degree - 1 - rank])

    def positions(self, t_local: int) -> jax.Array:
        chunk = t_local // 2
        return jnp.repeat(self.chunks(), chunk) * chunk + jnp.tile(jnp.arange(chunk), 2)

    def gathered_positions(self, t_local: int) -> jax.Array:
        return jnp.asarray(load_balanced_order(t_local * self.degree, self.degree))

    def pass_along(self, x: jax.Array) -> jax.Array:
        """Rank r's block to rank r + 1 (the ring's step; the last rank's to rank 0)."""
        return lax.ppermute(x, self.axis, [(r, (r + 1) % self.degree) for r in range(self.degree)])

    def gather(self, x: jax.Array) -> jax.Array:
        return lax.all_gather(x, self.axis, axis=1, tiled=True)

    def in_position_order(self, x: jax.Array) -> jax.Array:
        """A gathered (B, T, ...) array with its 2 x cp chunks put back in position order."""
        n = 2 * self.degree
        by_chunk = x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:])
        layout = [k for i in range(self.degree) for k in (i, n - 1 - i)]
        return jnp.take(by_chunk, np.argsort(layout), axis=1).reshape(x.shape)
