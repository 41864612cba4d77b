"""Cross-entropy with TorchTitan's reduction: fp32, summed, divided by global valid tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from titan_jax.models.sharding_hooks import constrain

IGNORE_INDEX = -100
# Above this many logits per microbatch the loss is computed chunk by chunk over tokens, so the
# full (tokens, vocab) fp32 logits never exist at once (e.g. 4096 tokens x 151936 vocab = 2.5 GB).
MAX_LOGITS_PER_CHUNK = 2**26


def token_cross_entropy_sum(logits_NV: jax.Array, labels_N: jax.Array) -> jax.Array:
    """Sum over non-ignored tokens of -log softmax(logits)[label], in fp32."""
    # Rows are the batch's tokens, batch-major: they split like the batch.
    logits_NV = constrain(logits_NV.astype(jnp.float32), ("batch", "vocab"))
    valid_N = labels_N != IGNORE_INDEX
    safe_labels = jnp.where(valid_N, labels_N, 0)
    label_logits = jnp.take_along_axis(logits_NV, safe_labels[:, None], axis=-1)[:, 0]
    nll_N = jax.nn.logsumexp(logits_NV, axis=-1) - label_logits
    return jnp.sum(jnp.where(valid_N, nll_N, 0.0))


def cross_entropy_sum(h_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array) -> jax.Array:
    """Summed CE of `h @ w` against labels, chunked over tokens when the logits are large."""
    d, v = w_DV.shape
    h_ND, labels_N = h_BTD.reshape(-1, d), labels_BT.reshape(-1)
    n = h_ND.shape[0]
    chunk = max(1, MAX_LOGITS_PER_CHUNK // v)
    if n <= chunk:
        logits = jnp.einsum("nd,dv->nv", h_ND, w_DV, preferred_element_type=jnp.float32)
        return token_cross_entropy_sum(logits, labels_N)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    h_CKD = jnp.pad(h_ND, ((0, pad), (0, 0))).reshape(n_chunks, chunk, d)
    labels_CK = jnp.pad(labels_N, (0, pad), constant_values=IGNORE_INDEX).reshape(n_chunks, chunk)

    @jax.checkpoint  # recompute each chunk's logits in backward instead of storing them
    def chunk_loss(total: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        h_KD, labels_K = xs
        logits = jnp.einsum("kd,dv->kv", h_KD, w_DV, preferred_element_type=jnp.float32)
        return total + token_cross_entropy_sum(logits, labels_K), None

    total, _ = jax.lax.scan(chunk_loss, jnp.zeros((), jnp.float32), (h_CKD, labels_CK))
    return total


def count_valid_tokens(labels: jax.Array) -> jax.Array:
    return jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)
