"""Cross-entropy with TorchTitan's reduction: fp32, summed, divided by global valid tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from titan_jax.data.windows import IGNORE_INDEX  # the data layer marks the ignored labels
from titan_jax.models.sharding_hooks import constrain

# Above this many logits per microbatch the loss is computed chunk by chunk over tokens, so the
# full (tokens, vocab) fp32 logits never exist at once (e.g. 4096 tokens x 151936 vocab = 2.5 GB).
MAX_LOGITS_PER_CHUNK = 2**26


def token_cross_entropy_sum(logits_RV: jax.Array, labels_R: jax.Array) -> jax.Array:
    """Sum over non-ignored tokens of -log softmax(logits)[label], in fp32."""
    # Rows are the batch's tokens, batch-major: they split like the batch.
    logits_RV = constrain(logits_RV.astype(jnp.float32), ("batch", "vocab"))
    valid_R = labels_R != IGNORE_INDEX
    safe_labels = jnp.where(valid_R, labels_R, 0)
    label_logits = jnp.take_along_axis(logits_RV, safe_labels[:, None], axis=-1)[:, 0]
    nll_R = jax.nn.logsumexp(logits_RV, axis=-1) - label_logits
    return jnp.sum(jnp.where(valid_R, nll_R, 0.0))


def cross_entropy_sum(h_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array) -> jax.Array:
    """Summed CE of `h @ w` against labels, chunked over tokens when the logits are large."""
    d, v = w_DV.shape
    h_RD, labels_R = h_BTD.reshape(-1, d), labels_BT.reshape(-1)
    n = h_RD.shape[0]
    chunk = max(1, MAX_LOGITS_PER_CHUNK // v)
    if n <= chunk:
        logits = jnp.einsum("nd,dv->nv", h_RD, w_DV, preferred_element_type=jnp.float32)
        return token_cross_entropy_sum(logits, labels_R)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    h_JID = jnp.pad(h_RD, ((0, pad), (0, 0))).reshape(n_chunks, chunk, d)
    labels_JI = jnp.pad(labels_R, (0, pad), constant_values=IGNORE_INDEX).reshape(n_chunks, chunk)
    return chunked_cross_entropy_sum(h_JID, w_DV, labels_JI)


def _chunk_logits(h_ID: jax.Array, w_DV: jax.Array) -> jax.Array:
    return jnp.einsum("kd,dv->kv", h_ID, w_DV, preferred_element_type=jnp.float32)


@jax.custom_vjp
def chunked_cross_entropy_sum(h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array
                              ) -> jax.Array:
    """Summed CE over token chunks; one chunk's fp32 logits exist at a time, in forward and in
    backward (recomputed there). The backward sums the output weight's gradient over chunks in
    fp32: accumulating it in a bf16 weight's dtype would lose precision with every chunk.

    Chunks are mapped (`lax.map`), not scanned with a scalar carry: inside shard_map a carry
    initialised from a constant has no manual-axis type and would not match the loop's output.
    """
    losses = jax.lax.map(lambda xs: token_cross_entropy_sum(_chunk_logits(xs[0], w_DV), xs[1]),
                         (h_JID, labels_JI))
    return jnp.sum(losses)


def _chunked_fwd(h_JID: jax.Array, w_DV: jax.Array, labels_JI: jax.Array
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    return chunked_cross_entropy_sum(h_JID, w_DV, labels_JI), (h_JID, w_DV, labels_JI)


def _chunked_bwd(residuals: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array
                 ) -> tuple[jax.Array, jax.Array, None]:
    h_JID, w_DV, labels_JI = residuals

    def chunk(dw_DV: jax.Array, xs: tuple[jax.Array, jax.Array]
              ) -> tuple[jax.Array, jax.Array]:
        h_ID, labels_I = xs
        _, pullback = jax.vjp(lambda logits: token_cross_entropy_sum(logits, labels_I),
                              _chunk_logits(h_ID, w_DV))
        (dlogits_IV,) = pullback(g)
        dh_ID = jnp.einsum("kv,dv->kd", dlogits_IV.astype(h_ID.dtype), w_DV,
                           preferred_element_type=jnp.float32).astype(h_ID.dtype)
        dw_DV = dw_DV + jnp.einsum("kd,kv->dv", h_ID, dlogits_IV.astype(h_ID.dtype),
                                   preferred_element_type=jnp.float32)
        return dw_DV, dh_ID

    # The fp32 accumulator starts from the weight itself (times 0), so it carries the weight's
    # manual-axis type inside shard_map.
    dw0 = (w_DV * 0).astype(jnp.float32)
    dw_DV, dh_JID = jax.lax.scan(chunk, dw0, (h_JID, labels_JI))
    return dh_JID, dw_DV.astype(w_DV.dtype), None


chunked_cross_entropy_sum.defvjp(_chunked_fwd, _chunked_bwd)


def count_valid_tokens(labels: jax.Array) -> jax.Array:
    return jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)
