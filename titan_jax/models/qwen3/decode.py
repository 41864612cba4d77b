"""KV-cached Qwen3 decoding as pure functions over the params dict (the trainer's tree).

The training model recomputes attention over the whole sequence; generation instead keeps every
layer's keys and values in a cache of `max_len` positions, runs the prompt once (`prefill`),
then one token per call (`decode_step`). Both are jitted by `generate`, the cache is donated so
it is updated in place, and each compiles once per prompt length / once in all.

Numerics are the training model's (model.py): fp32 norm statistics, RoPE tables and softmax,
weights cast to `dtype` at use, logits in fp32. Params are the stored tree (see hf.py's mapping
table): `layers` weights are stacked on a leading layer axis, so the layers run under `lax.scan`
with the cache's layer axis scanned alongside.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.models.qwen3.args import Qwen3Args
from titan_jax.models.qwen3.model import apply_rope, rope_tables
from titan_jax.models.qwen3.moe import grouped_matmul_for, route, routed_experts

Params = dict[str, Any]
KVCache = dict[str, jax.Array]  # {"k", "v"}: (layers, B, max_len, n_kv_heads, head_dim)


def init_cache(args: Qwen3Args, batch: int, max_len: int, dtype: Any) -> KVCache:
    shape = (args.n_layers, batch, max_len, args.n_kv_heads, args.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def _attend(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, start: jax.Array,
            scale: float) -> jax.Array:
    """Queries at positions start.. attend to cache positions <= their own (fp32 softmax)."""
    b, t, n, h = q_BTNH.shape
    kv, s = k_BSKH.shape[2], k_BSKH.shape[1]
    q_BTKGH = q_BTNH.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    visible_TS = jnp.arange(s)[None, :] <= (start + jnp.arange(t))[:, None]
    scores = jnp.where(visible_TS, scores * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v_BSKH).reshape(b, t, n, h)


def _moe(p: Params, args: Qwen3Args, h_BTD: jax.Array, dtype: Any) -> jax.Array:
    """Routed experts as in training, with a zero expert bias (HF's router: the bias is a
    training-time balancing buffer, not part of an exported model)."""
    h_ND = h_BTD.reshape(-1, h_BTD.shape[-1])
    experts, weights, _ = route(h_ND, p["gate"], jnp.zeros(args.num_experts), args.top_k,
                                args.norm_topk_prob)
    kernel = grouped_matmul_for(jax.devices()[0].platform)
    y_ND = routed_experts(h_ND, experts, weights, p["w1"].astype(dtype), p["w3"].astype(dtype),
                          p["w2"].astype(dtype), kernel)
    return y_ND.reshape(h_BTD.shape)


def forward(params: Params, args: Qwen3Args, tokens_BT: jax.Array, start: jax.Array,
            cache: KVCache, dtype: Any = jnp.float32) -> tuple[jax.Array, KVCache]:
    """Logits (B, T, V) in fp32 of tokens at positions start..start+T-1, and the cache with
    their keys and values written in. Earlier positions come from the cache."""
    b, t = tokens_BT.shape
    x_BTD = jnp.take(params["tok_embeddings"].astype(dtype), tokens_BT, axis=0)
    cos, sin = rope_tables(start + jnp.arange(t), args.head_dim, args.rope_theta, args.yarn)
    eps, scale = args.norm_eps, args.head_dim**-0.5

    def layer(x_BTD: jax.Array, xs: tuple[Params, jax.Array, jax.Array]
              ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        p, k_cache, v_cache = xs
        a = p["attention"]
        w = lambda name: a[name].astype(dtype)  # noqa: E731
        h_BTD = _rms_norm(x_BTD, p["attention_norm"]["weight"], eps)
        q = _rms_norm(jnp.einsum("btd,dnh->btnh", h_BTD, w("wq")), a["q_norm"]["weight"], eps)
        k = _rms_norm(jnp.einsum("btd,dkh->btkh", h_BTD, w("wk")), a["k_norm"]["weight"], eps)
        v = jnp.einsum("btd,dkh->btkh", h_BTD, w("wv"))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, 1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, 1)
        out_BTNH = _attend(q, k_cache.astype(dtype), v_cache.astype(dtype), start, scale)
        x_BTD = x_BTD + jnp.einsum("btnh,nhd->btd", out_BTNH, w("wo"))
        h_BTD = _rms_norm(x_BTD, p["ffn_norm"]["weight"], eps)
        if "moe" in p:
            x_BTD = x_BTD + _moe(p["moe"], args, h_BTD, dtype)
        else:
            f = p["feed_forward"]
            gate = jax.nn.silu(jnp.einsum("btd,df->btf", h_BTD, f["w1"].astype(dtype)))
            hidden = gate * jnp.einsum("btd,df->btf", h_BTD, f["w3"].astype(dtype))
            x_BTD = x_BTD + jnp.einsum("btf,fd->btd", hidden, f["w2"].astype(dtype))
        return x_BTD, (k_cache, v_cache)

    x_BTD, (k, v) = jax.lax.scan(layer, x_BTD, (params["layers"], cache["k"], cache["v"]))
    h_BTD = _rms_norm(x_BTD, params["norm"]["weight"], eps)
    w_DV = params["tok_embeddings"].T if args.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,dv->btv", h_BTD, w_DV.astype(dtype),
                        preferred_element_type=jnp.float32)
    return logits, {"k": k, "v": v}


def sample(logits_BV: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Next tokens (B,): argmax at temperature 0, else nucleus sampling of softmax(logits / T)
    over the smallest set of tokens whose probability reaches `top_p`."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if top_p < 1:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_BV, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        kept = jnp.where(before < top_p, sorted_BV, jnp.inf)
        cutoff = jnp.min(kept, axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV >= cutoff, logits_BV, -jnp.inf)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def generate(params: Params, args: Qwen3Args, prompt_BT: jax.Array, max_new_tokens: int, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | None = None, dtype: Any = jnp.float32) -> jax.Array:
    """Prompt + up to `max_new_tokens` tokens (B, T + n); stops early once every row has
    produced `eos_id` (rows that finished earlier repeat it)."""
    b, t = prompt_BT.shape
    max_len = t + max_new_tokens
    if max_len > args.max_seq_len:
        raise ValueError(f"prompt of {t} tokens + max_new_tokens={max_new_tokens} exceeds the "
                         f"model's max_seq_len={args.max_seq_len}")
    pick = functools.partial(sample, temperature=temperature, top_p=top_p)

    @functools.partial(jax.jit, donate_argnums=1)
    def prefill(params: Params, cache: KVCache, tokens: jax.Array, key: jax.Array
                ) -> tuple[jax.Array, KVCache]:
        logits, cache = forward(params, args, tokens, jnp.int32(0), cache, dtype)
        return pick(logits[:, -1], key), cache

    @functools.partial(jax.jit, donate_argnums=1)
    def decode_step(params: Params, cache: KVCache, token_B: jax.Array, pos: jax.Array,
                    key: jax.Array) -> tuple[jax.Array, KVCache]:
        logits, cache = forward(params, args, token_B[:, None], pos, cache, dtype)
        return pick(logits[:, -1], key), cache

    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    cache = init_cache(args, b, max_len, dtype)
    token, cache = prefill(params, cache, prompt_BT, keys[0])
    out = [token]
    done = token == eos_id if eos_id is not None else jnp.zeros((b,), bool)
    for i in range(1, max_new_tokens):
        if eos_id is not None and bool(jnp.all(done)):
            break
        token, cache = decode_step(params, cache, token, jnp.int32(t + i - 1), keys[i])
        if eos_id is not None:
            token = jnp.where(done, eos_id, token)
            done = done | (token == eos_id)
        out.append(token)
    return jnp.concatenate([prompt_BT, jnp.stack(out, axis=1)], axis=1)
