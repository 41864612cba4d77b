"""The embedding lookup's gradient: a bf16 table's rows summed in fp32, so a frequent token's
row does not stop growing at bf16's 8 bits of mantissa."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from titan_jax.models.embedding import embed_lookup


def test_a_frequent_tokens_bf16_row_gradient_is_summed_in_fp32():
    v, d, n = 8, 4, 4096
    table = jnp.ones((v, d), jnp.bfloat16)
    tokens = jnp.zeros((1, n), jnp.int32)  # one token, n times
    g = jnp.full((1, n, d), 0.01, jnp.bfloat16)
    _, pullback = jax.vjp(lambda t: embed_lookup(t, tokens, v), table)
    (grad,) = pullback(g)
    want = n * float(jnp.bfloat16(0.01))  # 40.96: exact in fp32, rounded once to bf16
    np.testing.assert_allclose(np.asarray(grad[0], np.float32), want, rtol=1e-2)
    assert not np.asarray(grad[1:], np.float32).any()
