"""Cross-entropy with TorchTitan's reduction: fp32, summed, divided by global valid tokens; and
the per-token log-probabilities preference losses sum per sequence (train/dpo.py), by the same
chunked, vocabulary-split path."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from titan_jax.data.windows import IGNORE_INDEX  # the data layer marks the ignored labels
from titan_jax.models.sharding_hooks import VocabSplit, constrain, vocab_split
from titan_jax.parallel.vocab_parallel import split_cross_entropy_sum, split_token_nll

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

    Under a vocabulary split (`vocab_split()`) `w_DV` is this shard's vocabulary slice
    (`parallel/vocab_parallel.split_cross_entropy_sum`); the result is the sum over this
    shard's own tokens."""
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


def _chunk_logits(h_ID: jax.Array, w_DV: jax.Array) -> jax.Array:
    return jnp.einsum("kd,dv->kv", h_ID, w_DV, preferred_element_type=jnp.float32)


# Hand-written VJP: the output weight's gradient is summed over chunks in fp32 (autodiff would
# sum it in the weight's dtype) and each chunk's logits are recomputed. Without it:
# tests/train/test_loss.py::test_bf16_weight_gradient_error_does_not_grow_with_chunks
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
    residuals: tuple[jax.Array, jax.Array, jax.Array],
    g_J: jax.Array,
    loss_of_logits: Callable[[jax.Array, jax.Array], jax.Array],
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


# Hand-written VJP: backward recomputes each chunk's logits, where autodiff through the chunk
# loop keeps every chunk's (all the tokens' logits). Without it:
# tests/train/test_loss.py::test_chunked_token_log_probs_keep_no_chunks_logits_for_backward
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
