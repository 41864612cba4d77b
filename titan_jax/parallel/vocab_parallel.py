"""The vocabulary tables split over the data shards (Megatron's vocab-parallel embedding and
loss, over FSDP's axes).

A Qwen3 vocabulary is large (151,936 x 4096 for 8B: 2.5 GB in fp32). Gathered like any FSDP
weight, each chip would hold the whole table in the compute dtype, and its gradient whole in
fp32 before the cross-shard reduction (XLA:TPU lowers that reduction of the per-shard gradient
as an all-reduce plus a slice: ~9 GiB of full-vocabulary buffers per chip for 8B). Instead the
rules table keeps the vocabulary split over the data axes in compute (`"vocab"` in
`rules.KEPT_IN_COMPUTE`), so each shard only ever reads its own slice, and the tokens travel:

- embedding: every shard's token ids are gathered, each shard looks up the rows its slice
  holds (zeros elsewhere) and a reduce-scatter returns each shard its own tokens' rows (one
  shard contributes each row, so the sum is exact in any dtype);
- output projection and loss: per chunk of tokens, every shard's hidden states are gathered,
  each shard computes the logits of its vocabulary slice, the logsumexp and the label's logit
  are reduced over shards, and in backward the hidden states' gradient is reduce-scattered in
  fp32 (`train/loss.py`).

Each weight's gradient is then complete on its own shard (every token has passed through),
with no full-vocabulary buffer anywhere. The tensor-parallel split of the vocabulary (`tp`)
stays with the partitioner, inside each shard's slice.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax


@dataclasses.dataclass(frozen=True)
class VocabParallel:
    """The vocabulary split over `axis` (a vmap axis name in the jit path, the manual mesh
    axes in the shard_map one) into `degree` contiguous slices, slice i on shard i (see
    `sharding_hooks.VocabSplit`)."""

    axis: str | tuple[str, ...]
    degree: int

    def _index(self) -> jax.Array:
        return lax.axis_index(self.axis)

    def offset(self, v_local: int) -> jax.Array:
        return self._index() * v_local

    def gather(self, x: jax.Array) -> jax.Array:
        return lax.all_gather(x, self.axis, axis=0, tiled=True)

    def scatter_sum(self, x: jax.Array) -> jax.Array:
        return lax.psum_scatter(x, self.axis, scatter_dimension=0, tiled=True)

    def own(self, x: jax.Array) -> jax.Array:
        n = x.shape[0] // self.degree
        return lax.dynamic_slice_in_dim(x, self._index() * n, n)

    def sum(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, self.axis)

    def max(self, x: jax.Array) -> jax.Array:
        return lax.pmax(x, self.axis)
