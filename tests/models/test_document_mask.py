"""Documents packed in one window with `training.document_mask`: each document's logits and
loss equal running it alone at its own positions (fp32), through the xla path and splash."""

import jax
import jax.numpy as jnp
import numpy as np

from tests.tiny_model import TINY
from titan_jax.data.windows import IGNORE_INDEX
from titan_jax.models.attention import causal_gqa_attention, splash_attention
from titan_jax.models.qwen3.build import build_model_def
from titan_jax.train.loss import cross_entropy_sum

LENGTHS = (5, 11, 1, 8)  # documents packed into one 25-token window


def _logits(model, params, tokens):
    h, w = jax.jit(lambda p, t: model.forward(p, model.init_buffers(), t)[:2])(params, tokens)
    return jnp.einsum("btd,dv->btv", h, w), h, w


def test_each_packed_document_equals_running_it_alone():
    model = build_model_def(TINY)
    rng = np.random.default_rng(0)  # random weights from numpy: nothing to compile
    params = jax.tree.map(
        lambda x: jnp.asarray(0.1 * rng.normal(size=x.shape), x.dtype), model.abstract_params
    )
    docs = [rng.integers(1, TINY.vocab_size, n) for n in LENGTHS]
    window = np.concatenate(docs)
    segments = np.repeat(np.arange(len(docs)), LENGTHS)
    positions = np.concatenate([np.arange(n) for n in LENGTHS])
    packed = jnp.asarray(np.stack([window, segments, positions], -1)[None], jnp.int32)
    logits, h, w = _logits(model, params, packed)
    next_tokens = np.append(window[1:], 0)
    # The label of each document's last token would be the next document's first: ignored.
    labels = np.where(
        np.isin(np.arange(len(window)), np.cumsum(LENGTHS) - 1), IGNORE_INDEX, next_tokens
    )
    packed_loss = jax.jit(cross_entropy_sum)(h, w, jnp.asarray(labels[None], jnp.int32))
    # Each document alone, one per row, padded at its end (causal: the padding cannot reach it).
    width = max(LENGTHS)
    alone_tokens = np.zeros((len(docs), width), np.int64)
    alone_labels = np.full((len(docs), width), IGNORE_INDEX)
    for i, doc in enumerate(docs):
        alone_tokens[i, : len(doc)] = doc
        alone_labels[i, : len(doc) - 1] = doc[1:]
    alone, h1, w1 = _logits(model, params, jnp.asarray(alone_tokens, jnp.int32))
    start = 0
    for i, doc in enumerate(docs):
        np.testing.assert_allclose(
            logits[0, start : start + len(doc)], alone[i, : len(doc)], atol=1e-5, rtol=1e-5
        )
        start += len(doc)
    alone_loss = jax.jit(cross_entropy_sum)(h1, w1, jnp.asarray(alone_labels, jnp.int32))
    np.testing.assert_allclose(float(packed_loss), float(alone_loss), rtol=1e-5)
    assert (labels != IGNORE_INDEX).sum() == len(window) - len(docs)  # one per document
    # Without the mask the later documents see the earlier ones: the check can fail.
    unmasked, _, _ = _logits(model, params, jnp.asarray(window[None], jnp.int32))
    assert float(jnp.max(jnp.abs(unmasked[0, 5:16] - logits[0, 5:16]))) > 1e-3


def test_splash_takes_the_segment_ids_like_the_xla_path():
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (1, 256, 2, 8))  # two 128-blocks: a skipped one too
    k, v = (jax.random.normal(x, (1, 256, 1, 8)) for x in keys[1:])
    ids = jnp.asarray(np.sort(np.random.default_rng(1).integers(0, 5, (1, 256)), axis=1))
    got = jax.jit(lambda *a: splash_attention(*a[:3], 8**-0.5, True, a[3]))(q, k, v, ids)
    want = causal_gqa_attention(q, k, v, 8**-0.5, ids)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5
    assert float(jnp.max(jnp.abs(want - causal_gqa_attention(q, k, v, 8**-0.5)))) > 1e-2
