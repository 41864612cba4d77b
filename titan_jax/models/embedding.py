"""The embedding lookup: its gradient scatter-added in fp32, and split over vocabulary shards
(`sharding_hooks.vocab_split()`, parallel/vocab_parallel.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from titan_jax.models.sharding_hooks import vocab_split

Array = jax.Array


# Hand-written VJP: the rows' gradient is scatter-added in fp32, where autodiff's `take`
# transposes to a scatter-add in the table's dtype. Without it:
# tests/models/test_embedding.py::test_a_frequent_tokens_bf16_row_gradient_is_summed_in_fp32
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def embed_lookup(table_VD: Array, tokens: Array, vocab_size: int) -> Array:
    """Rows of the embedding table; the gradient is scatter-added in fp32.

    A plain `take` transposes to a scatter-add in the table's dtype: in bf16, a frequent
    token's row would sum thousands of contributions at 8 bits of mantissa.
    """
    return jnp.take(table_VD, tokens, axis=0)


def _embed_lookup_fwd(table_VD: Array, tokens: Array, vocab_size: int) -> tuple[Array, Array]:
    return embed_lookup(table_VD, tokens, vocab_size), tokens


def _embed_lookup_bwd(vocab_size: int, tokens: Array, g: Array) -> tuple[Array, None]:
    d = g.shape[-1]
    grad_VD = (
        jnp.zeros((vocab_size, d), jnp.float32)
        .at[tokens.reshape(-1)]
        .add(g.reshape(-1, d).astype(jnp.float32))
    )
    return grad_VD.astype(g.dtype), None


embed_lookup.defvjp(_embed_lookup_fwd, _embed_lookup_bwd)


# Token rows looked up per chunk under a vocabulary split (all shards' tokens x D elements):
# the gathered rows, and their fp32 gradient in backward, exist one chunk at a time.
MAX_ROWS_PER_CHUNK = 2**26


def vocab_lookup(table_VD: Array, tokens_BT: Array, dtype: jnp.dtype) -> Array:
    """(B, T, D) embedding rows of `tokens_BT`, in `dtype`. Under a vocabulary split
    (`vocab_split()`) `table_VD` is this shard's slice (in fp32: the parallelism hands it over
    as stored): chunk by chunk of tokens, every shard's tokens are
    gathered, each shard looks up those its slice holds (zeros for the others) and a
    reduce-scatter returns each shard its own tokens' rows (one shard contributes each row, so
    the sum is exact: written in fp32, which XLA:CPU needs, and narrowed to bf16 by XLA:TPU).
    The table enters the chunk loop in fp32, so its gradient is summed over chunks in fp32."""
    split = vocab_split()
    v, d = table_VD.shape
    if split.degree == 1:
        return embed_lookup(table_VD, tokens_BT, v).astype(dtype)
    tokens_N = tokens_BT.reshape(-1)
    n = tokens_N.shape[0]
    chunk = max(1, min(n, MAX_ROWS_PER_CHUNK // (d * split.degree)))
    while n % chunk:  # token counts are powers of two in practice: no padding
        chunk -= 1
    table32 = table_VD.astype(jnp.float32)

    def lookup(tokens_K: Array) -> Array:
        local = split.gather(tokens_K) - split.offset(v)
        here = (local >= 0) & (local < v)
        rows = embed_lookup(table32, jnp.where(here, local, 0), v)
        return split.scatter_sum(jnp.where(here[:, None], rows, 0.0)).astype(dtype)

    rows = jax.lax.map(jax.checkpoint(lookup), tokens_N.reshape(n // chunk, chunk))
    return rows.reshape(*tokens_BT.shape, d)
