"""Cross-entropy with TorchTitan's reduction: fp32, summed, divided by global valid tokens; and
the per-token log-probabilities preference losses sum per sequence (train/dpo.py), by the same
chunked, vocabulary-split path."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.data.windows import IGNORE_INDEX  # the data layer marks the ignored labels
from titan_jax.models.sharding_hooks import VocabSplit, constrain, vocab_split

# Above this many logits per microbatch the loss is computed chunk by chunk over tokens, so the
# full (tokens, vocab) fp32 logits never exist at once (e.g. 4096 tokens x 151936 vocab = 2.5 GB).
MAX_LOGITS_PER_CHUNK = 2**26


def token_nll(logits_RV: jax.Array, labels_R: jax.Array) -> jax.Array:
    """-log softmax(logits)[label] of each token in fp32; 0 where the label is ignored."""
    # Rows are the batch's tokens, batch-major: they split like the batch.
    logits_RV = constrain(logits_RV.astype(jnp.float32), ("batch", "vocab"))
    valid_R = labels_R != IGNORE_INDEX
    safe_labels = jnp.where(valid_R, labels_R, 0)
    label_logits = jnp.take_along_axis(logits_RV, safe_labels[:, None], axis=-1)[:, 0]
    nll_R = jax.nn.logsumexp(logits_RV, axis=-1) - label_logits
    return jnp.where(valid_R, nll_R, 0.0)


def token_cross_entropy_sum(logits_RV: jax.Array, labels_R: jax.Array) -> jax.Array:
    """Sum over non-ignored tokens of -log softmax(logits)[label], in fp32."""
    return jnp.sum(token_nll(logits_RV, labels_R))


def _token_chunks(
    h_BTD: jax.Array, labels_BT: jax.Array, v: int, split: VocabSplit
) -> tuple[jax.Array, jax.Array] | None:
    """The flattened tokens as (chunks, tokens a chunk) of hidden states and labels (the tail
    padded with ignored labels), or None where one unsplit matmul's logits are small enough."""
    d = h_BTD.shape[-1]
    h_RD, labels_R = h_BTD.reshape(-1, d), labels_BT.reshape(-1)
    n = h_RD.shape[0]
    chunk = max(1, MAX_LOGITS_PER_CHUNK // (v * split.degree))  # a chunk's logits, all shards'
    if n <= chunk and split.degree == 1:
        return None
    chunk = min(chunk, n)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    h_JID = jnp.pad(h_RD, ((0, pad), (0, 0))).reshape(n_chunks, chunk, d)
    labels_JI = jnp.pad(labels_R, (0, pad), constant_values=IGNORE_INDEX).reshape(n_chunks, chunk)
    return h_JID, labels_JI


def _flat_logits(h_BTD: jax.Array, w_DV: jax.Array) -> jax.Array:
    """fp32 logits (tokens, vocab) of every token at once: for batches whose logits are small."""
    h_RD = h_BTD.reshape(-1, h_BTD.shape[-1])
    return jnp.einsum("nd,dv->nv", h_RD, w_DV, preferred_element_type=jnp.float32)


def cross_entropy_sum(h_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array) -> jax.Array:
    """Summed CE of `h @ w` against labels, chunked over tokens when the logits are large.

    Under a vocabulary split (`vocab_split()`, parallel/vocab_parallel.py) `w_DV` is this
    shard's vocabulary slice: each chunk's hidden states are gathered over the shards, every
    shard computes its slice's logits of all of them, and the softmax is reduced over shards;
    the result is the sum over this shard's own tokens."""
    split = vocab_split()
    chunks = _token_chunks(h_BTD, labels_BT, w_DV.shape[1], split)
    if chunks is None:
        return token_cross_entropy_sum(_flat_logits(h_BTD, w_DV), labels_BT.reshape(-1))
    h_JID, labels_JI = chunks
    if split.degree > 1:
        return split_cross_entropy_sum(h_JID, w_DV, labels_JI, split)
    return chunked_cross_entropy_sum(h_JID, w_DV, labels_JI)


def token_log_probs(h_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array) -> jax.Array:
    """log softmax(h @ w)[label] of each token (B, T), fp32, 0 where the label is ignored: what
    a sequence's log-probability sums. Chunked and vocabulary-split as `cross_entropy_sum`, so
    the (tokens, vocab) fp32 logits never exist at once; under a split, this shard's tokens."""
    split = vocab_split()
    chunks = _token_chunks(h_BTD, labels_BT, w_DV.shape[1], split)
    if chunks is None:
        return -token_nll(_flat_logits(h_BTD, w_DV), labels_BT.reshape(-1)).reshape(labels_BT.shape)
    h_JID, labels_JI = chunks
    if split.degree > 1:
        nll_JI = split_token_nll(h_JID, w_DV, labels_JI, split)
    else:
        nll_JI = chunked_token_nll(h_JID, w_DV, labels_JI)
    return -nll_JI.reshape(-1)[: labels_BT.size].reshape(labels_BT.shape)


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
    h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array, split: VocabSplit, reduce: Any
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
    shards' axis. The weight enters
    in fp32 (the parallelism hands the tables over as stored), so its gradient is summed over
    chunks in fp32, and the hidden states' gradient over shards (their gather is fp32)."""
    return jnp.sum(_split_chunks_map(h_JID, w_DV, labels_JI, split, jnp.sum))


def split_token_nll(
    h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array, split: VocabSplit
) -> jax.Array:
    """Per-token NLL (chunks, tokens) of this shard's tokens under a vocabulary split, as
    `split_cross_entropy_sum` computes them."""
    return _split_chunks_map(h_JID, w_DV, labels_JI, split, lambda nll: nll)


def _chunk_logits(h_ID: jax.Array, w_DV: jax.Array) -> jax.Array:
    return jnp.einsum("kd,dv->kv", h_ID, w_DV, preferred_element_type=jnp.float32)


@jax.custom_vjp
def chunked_cross_entropy_sum(h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array) -> jax.Array:
    """Summed CE over token chunks; one chunk's fp32 logits exist at a time, in forward and in
    backward (recomputed there). The backward sums the output weight's gradient over chunks in
    fp32: accumulating it in a bf16 weight's dtype would lose precision with every chunk.

    Chunks are mapped (`lax.map`), not scanned with a scalar carry: inside shard_map a carry
    initialised from a constant has no manual-axis type and would not match the loop's output.
    """
    losses = jax.lax.map(
        lambda xs: token_cross_entropy_sum(_chunk_logits(xs[0], w_DV), xs[1]), (h_JID, labels_JI)
    )
    return jnp.sum(losses)


def _chunked_fwd(
    h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    return chunked_cross_entropy_sum(h_JID, w_DV, labels_JI), (h_JID, w_DV, labels_JI)


def _chunked_bwd(
    residuals: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array
) -> tuple[jax.Array, jax.Array, None]:
    g_J = jnp.broadcast_to(g, residuals[2].shape[:1])  # each chunk's sum gets the same g
    return _chunks_backward(residuals, g_J, token_cross_entropy_sum)


def _chunks_backward(
    residuals: tuple[jax.Array, jax.Array, jax.Array], g_J: jax.Array, loss_of_logits: Any
) -> tuple[jax.Array, jax.Array, None]:
    """The gradients of h and w of `loss_of_logits(logits, labels)` per chunk, given each
    chunk's cotangent `g_J` (J leading): one chunk's logits are recomputed at a time, and the
    output weight's gradient is summed over chunks in fp32."""
    h_JID, w_DV, labels_JI = residuals

    def chunk(
        dw_DV: jax.Array, xs: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        h_ID, labels_I, g = xs
        _, pullback = jax.vjp(
            lambda logits: loss_of_logits(logits, labels_I), _chunk_logits(h_ID, w_DV)
        )
        (dlogits_IV,) = pullback(g)
        dh_ID = jnp.einsum(
            "kv,dv->kd", dlogits_IV.astype(h_ID.dtype), w_DV, preferred_element_type=jnp.float32
        ).astype(h_ID.dtype)
        dw_DV = dw_DV + jnp.einsum(
            "kd,kv->dv", h_ID, dlogits_IV.astype(h_ID.dtype), preferred_element_type=jnp.float32
        )
        return dw_DV, dh_ID

    # Inside shard_map the sum varies over every manual axis its terms vary over (the data
    # axes of h when w is replicated): so must the carry it starts from.
    varying = _varying(h_JID, w_DV, labels_JI, g_J)
    dw0 = jnp.zeros(w_DV.shape, jnp.float32)
    if varying:
        dw0 = jax.lax.pcast(dw0, tuple(sorted(varying)), to="varying")
    dw_DV, dh_JID = jax.lax.scan(chunk, dw0, (h_JID, labels_JI, g_J))
    return _like(dh_JID, h_JID), _like(dw_DV, w_DV).astype(w_DV.dtype), None


def _varying(*xs: jax.Array) -> frozenset[str]:
    """The manual (shard_map) axes any of `xs` varies over."""
    return frozenset().union(*(jax.typeof(x).mat.varying for x in xs))


def _like(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """`cotangent` summed over the manual axes it varies over and `primal` does not: a value
    the same on every shard of an axis (a replicated weight) was used by each shard's terms,
    and its gradient is their sum, as autodiff makes it for the implicit broadcast."""
    extra = _varying(cotangent) - _varying(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


chunked_cross_entropy_sum.defvjp(_chunked_fwd, _chunked_bwd)


@jax.custom_vjp
def chunked_token_nll(h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array) -> jax.Array:
    """Per-token NLL (chunks, tokens) chunk by chunk: `chunked_cross_entropy_sum` before its
    sum, with the same memory-bounded backward."""
    return jax.lax.map(lambda xs: token_nll(_chunk_logits(xs[0], w_DV), xs[1]), (h_JID, labels_JI))


def _token_nll_fwd(
    h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    return chunked_token_nll(h_JID, w_DV, labels_JI), (h_JID, w_DV, labels_JI)


def _token_nll_bwd(
    residuals: tuple[jax.Array, jax.Array, jax.Array], g_JI: jax.Array
) -> tuple[jax.Array, jax.Array, None]:
    return _chunks_backward(residuals, g_JI, token_nll)


chunked_token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


def count_valid_tokens(labels: jax.Array) -> jax.Array:
    return jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)
