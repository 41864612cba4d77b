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
  shard contributes each row, so the sum is exact in any dtype). It is written out over the
  mesh axes on the shard_map path (`reduce_scatter.staged_psum_scatter`): XLA:TPU lowers a
  reduce-scatter over a v5p-16's eight chips as a full-size all-reduce (the jit path's vmap
  axis keeps the single form, fine on v5p-8 and v6e-8);
- output projection and loss: per chunk of tokens, every shard's hidden states are gathered,
  each shard computes the logits of its vocabulary slice, the logsumexp and the label's logit
  are reduced over shards, and in backward the hidden states' gradient is reduce-scattered in
  fp32 (`train/loss.py`).

Each weight's gradient is then complete on its own shard (every token has passed through),
with no full-vocabulary buffer anywhere. The tokens' traffic grows with the shards: where a
microbatch's tokens over the shards outnumber the vocabulary's rows, gathering the tables as
FSDP weights moves fewer bytes, and the rules table does that (`rules.table_for_vocab`). The
tensor-parallel split of the vocabulary (`tp`) stays with the partitioner, inside each shard's
slice.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax

from titan_jax.parallel.reduce_scatter import staged_psum_scatter


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_rows(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Inside shard_map: every shard's rows of `x` stacked along dim 0 (shard-major); its
    transpose is the staged reduce-scatter, not the single psum_scatter XLA:TPU would lower as
    an all-reduce on larger groups."""
    return lax.all_gather(x, axes, axis=0, tiled=True)


def _gather_rows_fwd(x: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, None]:
    return gather_rows(x, axes), None


def _gather_rows_bwd(axes: tuple[str, ...], _: None, g: jax.Array) -> tuple[jax.Array]:
    return (staged_psum_scatter(g, axes),)


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


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
        if isinstance(self.axis, tuple):  # the shard_map path's manual mesh axes
            return gather_rows(x, self.axis)
        return lax.all_gather(x, self.axis, axis=0, tiled=True)

    def scatter_sum(self, x: jax.Array) -> jax.Array:
        if isinstance(self.axis, tuple):
            return staged_psum_scatter(x, self.axis)
        # The jit path's vmap axis: XLA:TPU emits its reduce-scatter on v5p-8 and v6e-8; in
        # groups of more than four v5p chips an all-reduce (docs/TPU.md).
        return lax.psum_scatter(x, self.axis, scatter_dimension=0, tiled=True)

    def own(self, x: jax.Array) -> jax.Array:
        n = x.shape[0] // self.degree
        return lax.dynamic_slice_in_dim(x, self._index() * n, n)

    def sum(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, self.axis)

    def max(self, x: jax.Array) -> jax.Array:
        return lax.pmax(x, self.axis)
