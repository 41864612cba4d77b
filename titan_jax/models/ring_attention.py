"""Ring attention over a split sequence (`parallelism.context_parallel_method = "ring"`).

Each rank holds its two load-balanced chunks of every sequence (chunks r and 2cp-1-r of 2cp,
`parallel/context_parallel.py`). Its K/V block travels around the ring (`pass_along`, a
`ppermute`), cp - 1 times, and each rank folds every block it holds into an online softmax
(running max `m`, sum `l`, unnormalised output `o`, all fp32), so no rank ever holds the
whole sequence's K/V at once in the forward.

The load balance also halves the work after the first step: the block a rank holds at step
s > 0 came from rank src = r - s (mod cp). If src < r, both of its query chunks see all of
the block's early chunk and none of its late one; if src > r, only the late query chunk sees
anything, and all of the block. Either way it is one (2c x c) product of the (2c x 2c) block
(c = T / 2cp), chosen by a `lax.cond` on the traced ranks. Step 0 is the causal diagonal.

Gradients: autodiff through the unrolled ring (`ppermute` transposes to the reverse ring),
with each query block's scores rematerialised (`jax.checkpoint`), so a step's (rows x keys)
scores exist one query block at a time, forward and backward. What autodiff keeps are the
blocks each rank received (as many bytes as the all-gather's K/V) and the running sums.
The blocks are XLA einsums: splash's public API has no block-wise log-sum-exp backward, so
the ring runs with `model.attention = xla` (the trainer refuses splash with it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from titan_jax.models.sharding_hooks import SequenceSplit

Array = jax.Array
# Query rows per rematerialised block: bounds a step's fp32 scores to (heads x 512 x keys).
QUERY_BLOCK = 512
_MIN = float(jnp.finfo(jnp.float32).min)
Partial = tuple[Array, Array, Array]  # o (B, K, G, T, H), m (B, K, G, T), l (B, K, G, T)


def _block(
    q: Array,
    k: Array,
    v: Array,
    scale: float,
    q_pos: Array,
    k_pos: Array,
    q_ids: Array | None,
    k_ids: Array | None,
) -> Partial:
    """One query block (q (B, Tq, K, G, H)) against one K/V block (B, S, K, H): its
    unnormalised output, row max and row sum, masked causally by position and by segment."""
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    allowed = (q_pos[:, None] >= k_pos[None, :])[None, None, None]
    if q_ids is not None and k_ids is not None:  # (both or neither)
        allowed = allowed & (q_ids[:, :, None] == k_ids[:, None, :])[:, None, None]
    scores = jnp.where(allowed, scores * scale, _MIN)
    m = lax.stop_gradient(jnp.max(scores, axis=-1))  # a stabiliser: the result is invariant
    p = jnp.where(allowed, jnp.exp(scores - m[..., None]), 0.0)
    o = jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m, jnp.sum(p, axis=-1)


def _blocked(
    q: Array,
    k: Array,
    v: Array,
    scale: float,
    q_pos: Array,
    k_pos: Array,
    q_ids: Array | None,
    k_ids: Array | None,
) -> Partial:
    """`_block` over QUERY_BLOCK rows at a time, each rematerialised in the backward."""
    rows = q.shape[1]
    size = QUERY_BLOCK if rows % QUERY_BLOCK == 0 else rows
    n = rows // size

    def one(args: tuple[Array, ...]) -> Partial:
        qb, pb, ib = args
        return _block(qb, k, v, scale, pb, k_pos, ib, k_ids)

    def split(x: Array, d: int) -> Array:
        return jnp.moveaxis(x.reshape(*x.shape[:d], n, size, *x.shape[d + 1 :]), d, 0)

    ids = None if q_ids is None else split(q_ids, 1)
    o, m, l = lax.map(jax.checkpoint(one), (split(q, 1), split(q_pos, 0), ids))
    join = lambda x: jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], rows, *x.shape[5:])  # noqa: E731
    return join(o), join(m), join(l)


def _combine(a: Partial, b: Partial) -> Partial:
    """Two partial softmaxes over disjoint keys as one."""
    (o1, m1, l1), (o2, m2, l2) = a, b
    m = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return o1 * w1[..., None] + o2 * w2[..., None], m, l1 * w1 + l2 * w2


def _late_rows_only(part: Partial, early_rows: int) -> Partial:
    """A partial over the late query chunk, padded with empty rows for the early one."""
    o, m, l = part

    def pad(x: Array, fill: float) -> Array:
        early = jnp.full((*x.shape[:3], early_rows, *x.shape[4:]), fill, x.dtype)
        return jnp.concatenate([early, x], axis=3)

    return pad(o, 0.0), pad(m, _MIN), pad(l, 0.0)


def ring_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    scale: float,
    split: SequenceSplit,
    segment_ids_BT: Array | None = None,
) -> Array:
    """This rank's queries (its two chunks, B, 2c, N, H) against every rank's K/V, passed
    around the ring; equal to causal attention over the whole sequence."""
    b, t, n, h = q_BTNH.shape
    kv, c, cp = k_BSKH.shape[2], t // 2, split.degree
    q = q_BTNH.reshape(b, t, kv, n // kv, h)
    q_pos, rank = split.positions(t), split.chunks()[0]
    ids, kv_ids = segment_ids_BT, segment_ids_BT
    k, v = k_BSKH, v_BSKH
    acc = _blocked(q, k, v, scale, q_pos, q_pos, ids, kv_ids)  # step 0: the causal diagonal
    for step in range(1, cp):
        k, v = split.pass_along(k), split.pass_along(v)
        kv_ids = None if kv_ids is None else split.pass_along(kv_ids)
        src = (rank - step) % cp
        k_pos = jnp.concatenate([src * c + jnp.arange(c), (2 * cp - 1 - src) * c + jnp.arange(c)])

        def early_keys(k=k, v=v, k_pos=k_pos, kv_ids=kv_ids) -> Partial:
            early = None if kv_ids is None else kv_ids[:, :c]
            return _blocked(q, k[:, :c], v[:, :c], scale, q_pos, k_pos[:c], ids, early)

        def late_queries(k=k, v=v, k_pos=k_pos, kv_ids=kv_ids) -> Partial:
            late = None if ids is None else ids[:, c:]
            return _late_rows_only(
                _blocked(q[:, c:], k, v, scale, q_pos[c:], k_pos, late, kv_ids), c
            )

        acc = _combine(acc, lax.cond(src < rank, early_keys, late_queries))
    o, _, l = acc
    out = o / l[..., None]  # every query sees at least itself: l > 0
    return jnp.moveaxis(out, 3, 1).reshape(b, t, n, h).astype(q_BTNH.dtype)
