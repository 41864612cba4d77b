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
- output projection and loss (`split_cross_entropy_sum`, `split_token_nll`, called by
  `train/loss.py`): per chunk of tokens, every shard's hidden states are gathered, each shard
  computes the logits of its vocabulary slice, the logsumexp and the label's logit are reduced
  over shards, and in backward the hidden states' gradient is reduce-scattered in fp32.

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
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from titan_jax.data.windows import IGNORE_INDEX
from titan_jax.models.sharding_hooks import VocabSplit, constrain
from titan_jax.parallel.reduce_scatter import staged_psum_scatter


# Hand-written VJP: its transpose is the staged reduce-scatter, where autodiff's single
# psum_scatter is lowered by XLA:TPU as an all-reduce over eight v5p chips. Without it:
# tests/parallel/test_tpu_aot.py::test_vocabulary_rows_are_reduce_scattered_on_eight_chips
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


# Hand-written VJP: the gradients leave the matmuls' fp32 accumulators as they are, where
# autodiff would round them to the compute dtype first. Without it:
# tests/parallel/test_vocab_parallel.py::
# test_the_bf16_split_losss_weight_gradient_is_not_rounded_to_bf16
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logits(h_ID: jax.Array, w_DV: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """fp32 logits of fp32 `h` and `w` multiplied in `dtype` (the compute dtype). Its backward
    returns fp32 gradients straight from the matmuls' fp32 accumulators, so neither the
    weight's gradient summed over chunks nor the hidden states' summed over vocabulary shards
    is rounded to the compute dtype on the way."""
    return jnp.einsum(
        "kd,dv->kv", h_ID.astype(dtype), w_DV.astype(dtype), preferred_element_type=jnp.float32
    )


def _logits_fwd(
    h_ID: jax.Array, w_DV: jax.Array, dtype: jnp.dtype
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _logits(h_ID, w_DV, dtype), (h_ID, w_DV)


def _logits_bwd(
    dtype: jnp.dtype, residuals: tuple[jax.Array, jax.Array], g_IV: jax.Array
) -> tuple[jax.Array, jax.Array]:
    h_ID, w_DV = (x.astype(dtype) for x in residuals)
    g_IV = g_IV.astype(dtype)
    return (
        jnp.einsum("kv,dv->kd", g_IV, w_DV, preferred_element_type=jnp.float32),
        jnp.einsum("kd,kv->dv", h_ID, g_IV, preferred_element_type=jnp.float32),
    )


_logits.defvjp(_logits_fwd, _logits_bwd)


def _chunk_nll(
    h_ID: jax.Array, w_DV: jax.Array, labels_I: jax.Array, split: VocabSplit, dtype: jnp.dtype
) -> jax.Array:
    """One chunk: the logits of every shard's tokens (rows) over this shard's vocabulary slice
    (fp32 `h` and `w`), the softmax reduced over shards; the NLL of this shard's tokens (0 where
    ignored)."""
    v = w_DV.shape[1]
    logits = constrain(_logits(split.gather(h_ID), w_DV, dtype), ("batch", "vocab"))
    labels = split.gather(labels_I)
    local = labels - split.offset(v)
    here = (local >= 0) & (local < v)
    row_max = split.max(jnp.max(jax.lax.stop_gradient(logits), axis=-1))
    denom = split.sum(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1))
    label_logit = jnp.take_along_axis(logits, jnp.where(here, local, 0)[:, None], axis=-1)[:, 0]
    label_logit = split.sum(jnp.where(here, label_logit, 0.0))
    nll = split.own(row_max + jnp.log(denom) - label_logit)  # this shard's tokens only
    return jnp.where(labels_I != IGNORE_INDEX, nll, 0.0)


def _split_chunks_map(
    h_JID: jax.Array,
    w_DV: jax.Array,
    labels_JI: jax.Array,
    split: VocabSplit,
    reduce: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """`reduce` of each chunk's NLLs (`_chunk_nll`), chunk by chunk (see
    `split_cross_entropy_sum`)."""
    dtype = h_JID.dtype
    w32 = w_DV.astype(jnp.float32)

    def chunk(xs: tuple[jax.Array, jax.Array]) -> jax.Array:
        return reduce(_chunk_nll(xs[0].astype(jnp.float32), w32, xs[1], split, dtype))

    if h_JID.shape[0] > 1:  # one chunk's logits are kept for backward, several recomputed
        chunk = jax.checkpoint(chunk)
    return jax.lax.map(chunk, (h_JID, labels_JI))


def split_cross_entropy_sum(
    h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array, split: VocabSplit
) -> jax.Array:
    """Summed CE over token chunks under a vocabulary split, this shard's tokens; one chunk's
    fp32 logits (all shards' tokens, this shard's vocabulary) exist at a time, in forward and
    in backward (several chunks are rematerialised; a single one is kept). Differentiated by
    JAX, not a custom_vjp: under the jit path's vmap a custom_vjp's backward cannot name the
    shards' axis. The weight enters in fp32 (the parallelism hands the tables over as stored),
    so its gradient is summed over chunks in fp32, and the hidden states' gradient over shards
    (their gather is fp32)."""
    return jnp.sum(_split_chunks_map(h_JID, w_DV, labels_JI, split, jnp.sum))


def split_token_nll(
    h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array, split: VocabSplit
) -> jax.Array:
    """Per-token NLL (chunks, tokens) of this shard's tokens under a vocabulary split, as
    `split_cross_entropy_sum` computes them."""
    return _split_chunks_map(h_JID, w_DV, labels_JI, split, lambda nll: nll)
