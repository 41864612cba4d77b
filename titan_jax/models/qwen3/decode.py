"""KV-cached Qwen3 decoding through the training model (model.py), over the params dict.

The training forward runs the whole sequence at once; generation instead keeps every layer's
keys and values in a cache of `max_len` positions, runs the prompt once (`prefill`), then one
token per call (`decode_step`). Both are the training model's `hidden_states` with its KV cache
and position offset, so the numerics are the training model's (fp32 norm statistics, RoPE
tables and softmax, weights cast to `dtype` at use, logits in fp32). Both are jitted by
`generate`, the cache is donated so it is updated in place, and each compiles once per prompt
length / once in all. The kernels follow the platform of the devices the weights are on.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from titan_jax.models.qwen3.args import Qwen3Args
from titan_jax.models.qwen3.build import Qwen3Def, build_model_def
from titan_jax.models.spec import BuildOptions

Params = dict[str, Any]
KVCache = dict[str, jax.Array]  # {"k", "v"}: (layers, B, max_len, n_kv_heads, head_dim)


def init_cache(args: Qwen3Args, batch: int, max_len: int, dtype: Any) -> KVCache:
    shape = (args.n_layers, batch, max_len, args.n_kv_heads, args.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


@functools.lru_cache(maxsize=8)
def _model(args: Qwen3Args, platform: str) -> Qwen3Def:
    """The model for decoding on `platform`: a KV cache needs the xla attention."""
    return build_model_def(args, BuildOptions(platform=platform, attention="xla"))


def forward(
    params: Params,
    args: Qwen3Args,
    tokens_BT: jax.Array,
    start: jax.Array,
    cache: KVCache,
    dtype: Any = jnp.float32,
    platform: str = "cpu",
) -> tuple[jax.Array, KVCache]:
    """Logits (B, T, V) in fp32 of tokens at positions start..start+T-1, and the cache with
    their keys and values written in. Earlier positions come from the cache. MoE flavours
    route with a zero expert bias (HF's router: the bias is a training-time buffer)."""
    net = nnx.merge(_model(args, platform).graphdef, params)
    h_BTD, _, _, (k, v) = net.hidden_states(
        tokens_BT, dtype, kv_cache=(cache["k"], cache["v"]), start=start
    )
    logits = jnp.einsum(
        "btd,dv->btv", h_BTD, net.output_weight(dtype), preferred_element_type=jnp.float32
    )
    return logits, {"k": k, "v": v}


def platform_of(params: Params) -> str:
    """The platform of the devices holding `params` (host arrays: JAX's default backend)."""
    leaf = jax.tree.leaves(params)[0]
    if isinstance(leaf, jax.Array):
        return next(iter(leaf.devices())).platform
    return jax.default_backend()


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


def generate(
    params: Params,
    args: Qwen3Args,
    prompt_BT: jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    dtype: Any = jnp.float32,
) -> jax.Array:
    """Prompt + up to `max_new_tokens` tokens (B, T + n); stops early once every row has
    produced `eos_id` (rows that finished earlier repeat it)."""
    b, t = prompt_BT.shape
    max_len = t + max_new_tokens
    if max_len > args.max_seq_len:
        raise ValueError(
            f"prompt of {t} tokens + max_new_tokens={max_new_tokens} exceeds the "
            f"model's max_seq_len={args.max_seq_len}"
        )
    pick = functools.partial(sample, temperature=temperature, top_p=top_p)
    platform = platform_of(params)

    @functools.partial(jax.jit, donate_argnums=1)
    def prefill(
        params: Params, cache: KVCache, tokens: jax.Array, key: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        logits, cache = forward(params, args, tokens, jnp.int32(0), cache, dtype, platform)
        return pick(logits[:, -1], key), cache

    @functools.partial(jax.jit, donate_argnums=1)
    def decode_step(
        params: Params, cache: KVCache, token_B: jax.Array, pos: jax.Array, key: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        logits, cache = forward(params, args, token_B[:, None], pos, cache, dtype, platform)
        return pick(logits[:, -1], key), cache

    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    cache = init_cache(args, b, max_len, dtype)
    token, cache = prefill(params, cache, prompt_BT, keys[0])
    out: list[jax.Array] = [token]
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
