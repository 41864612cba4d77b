"""Causal GQA attention backends (`model.attention`), chosen by the target devices' platform.

- "xla": einsum + fp32 masked softmax; materialises the (B, K, G, T, S) scores, so its memory
  grows with T^2. The CPU default, and the reference the kernels are tested against.
- "splash": the Pallas TPU kernel (`jax.experimental.pallas.ops.tpu.splash_attention`): blocked
  online softmax, nothing of size T^2 is stored. On CPU it runs in Pallas interpret mode (slow;
  for tests). A Pallas kernel is opaque to GSPMD, so it goes through the `run_per_shard` hook:
  parallelism runs it on each device's rows and heads (a shard_map from the rules table).
- "cudnn": cuDNN's fused attention through `jax.nn.dot_product_attention` (GPU; bf16/fp16).
- "auto": splash on TPU, cudnn on GPU (bf16/fp16 compute), xla otherwise.

All take q (B, T, N, H) and k, v (B, S, K, H) with N a multiple of K (query head n uses kv head
n // (N/K), as in HF) and return (B, T, N, H) in q's dtype. Optional segment ids (B, T) keep
attention within equal ids (documents packed in one window): the xla path masks, splash takes
them as its `SegmentIds`; cudnn does not take them here (the trainer refuses the setting).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from titan_jax.config_schema import ConfigError
from titan_jax.models.ring_attention import ring_attention
from titan_jax.models.sharding_hooks import (
    SequenceSplit,
    run_per_shard,
    sequence_split,
    split_degree,
)

Array = jax.Array
ATTENTION_BACKENDS = ("auto", "xla", "splash", "cudnn")
# Backends that run under context parallelism (a query shard against gathered K/V).
CP_ATTENTION = ("xla", "splash")
Q_AXES = ("batch", "seq", "heads", "head_dim")
KV_AXES = ("batch", "seq", "kv_heads", "head_dim")
# Splash tiles, largest first: the kernel needs kv blocks that are multiples of 128 lanes; 512
# is what MaxText uses on v5p/v6e.
SPLASH_BLOCKS = (512, 256, 128)


def resolve_attention(
    choice: str,
    platform: str,
    dtype: jnp.dtype | None = None,
    seq_lens: dict[str, int] | None = None,
) -> str:
    """The backend `model.attention = choice` means on `platform` ("cpu" | "tpu" | "gpu", the
    target devices'), for compute in `dtype` (None: the platform's default, bf16 off CPU) and
    the sequence lengths the run uses ({config key: length}; splash needs them tiled).

    "auto" never fails: on TPU it falls back to xla for lengths splash cannot tile, on GPU for
    fp32 compute. An explicit choice that cannot run is a ConfigError saying what would."""
    if choice not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"model.attention={choice!r} is not valid; expected one of "
            f"{', '.join(ATTENTION_BACKENDS)}"
        )
    half = dtype is None or jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    seq_lens = seq_lens or {}
    if choice == "auto":
        if platform == "tpu":
            tiled = all(n % SPLASH_BLOCKS[-1] == 0 for n in seq_lens.values())
            return "splash" if tiled else "xla"
        return "cudnn" if platform == "gpu" and half else "xla"
    if choice == "cudnn" and platform != "gpu":
        raise ConfigError(
            f"model.attention=cudnn needs GPU devices (the target devices are "
            f"{platform}); use auto or xla"
        )
    if choice == "cudnn" and not half:
        raise ConfigError(
            f"model.attention=cudnn computes in bf16/fp16 only, not "
            f"{jnp.dtype(dtype).name}; set training.mixed_precision_param="
            "bfloat16, or use model.attention=xla"
        )
    if choice == "splash" and platform == "gpu":
        raise ConfigError(
            "model.attention=splash is a TPU kernel (the target devices are gpu); use auto or cudnn"
        )
    if choice == "splash":
        for field, n in seq_lens.items():
            splash_block(n, field)
    return choice


def splash_block(seq_len: int, field: str = "training.seq_len") -> int:
    """The splash tile for sequences of `seq_len`: the largest of SPLASH_BLOCKS dividing it.
    `field` is the config key that set the length (named in the error)."""
    for block in SPLASH_BLOCKS:
        if seq_len % block == 0:
            return block
    fit = max(SPLASH_BLOCKS[-1], seq_len // SPLASH_BLOCKS[-1] * SPLASH_BLOCKS[-1])
    raise ConfigError(
        f"{field}={seq_len} must be a multiple of {SPLASH_BLOCKS[-1]} for "
        f"model.attention=splash (its block size); use e.g. {fit}, or "
        "model.attention=xla"
    )


def causal_gqa_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    scale: float,
    segment_ids_BT: Array | None = None,
    q_pos_T: Array | None = None,
    k_pos_S: Array | None = None,
    kv_segment_ids_BS: Array | None = None,
) -> Array:
    """Causal softmax attention; each group of n_heads/n_kv query heads shares one kv head.
    segment_ids_BT: attend within equal ids only (kv_segment_ids_BS: the keys' ids, when they
    differ from the queries'). q_pos_T, k_pos_S: the tokens' positions when they are not
    0..T-1 and 0..S-1 (context parallelism: a shard of queries against the gathered keys);
    the causal mask is then by position."""
    b, t, n, h = q_BTNH.shape
    kv = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    q_pos = jnp.arange(t) if q_pos_T is None else q_pos_T
    k_pos = jnp.arange(k_BSKH.shape[1]) if k_pos_S is None else k_pos_S
    allowed = q_pos[:, None] >= k_pos[None, :]  # (T, S) causal
    if segment_ids_BT is not None:  # and within one document: (B, 1, 1, T, S)
        kv_ids = segment_ids_BT if kv_segment_ids_BS is None else kv_segment_ids_BS
        same = segment_ids_BT[:, :, None] == kv_ids[:, None, :]
        allowed = (allowed & same)[:, None, None]
    scores = jnp.where(allowed, scores * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKH.dtype)  # fp32 softmax, as HF
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BSKH)
    return out.reshape(b, t, n, h)


def splash_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    scale: float,
    interpret: bool = False,
    segment_ids_BT: Array | None = None,
) -> Array:
    """The splash kernel on these (local) arrays: one example per kernel call, vmapped over
    the batch, heads-major layout. The kernel does not scale: q is pre-scaled."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    t, n = q_BTNH.shape[1], q_BTNH.shape[2]
    if k_BSKH.shape[1] != t:
        raise ValueError(
            f"splash attention here is self-attention: q has {t} positions, k {k_BSKH.shape[1]}"
        )
    block = splash_block(t)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = splash.MultiHeadMask([splash.CausalMask((t, t))] * n)
    kernel = splash.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    heads_major = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # (B, T, N, H) <-> (B, N, T, H)
    q = q_BTNH * jnp.asarray(scale, q_BTNH.dtype)
    if segment_ids_BT is None:
        out_BNTH = jax.vmap(kernel)(heads_major(q), heads_major(k_BSKH), heads_major(v_BSKH))
    else:
        with_ids = lambda q, k, v, ids: kernel(  # noqa: E731
            q, k, v, segment_ids=splash.SegmentIds(q=ids, kv=ids)
        )
        out_BNTH = jax.vmap(with_ids)(
            heads_major(q), heads_major(k_BSKH), heads_major(v_BSKH), segment_ids_BT
        )
    # The kernel is built without save_residuals: it returns the output alone.
    assert isinstance(out_BNTH, jax.Array)
    return heads_major(out_BNTH)


def splash_cp_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    scale: float,
    cp: int,
    chunks: Array,
    interpret: bool = False,
    q_ids_BT: Array | None = None,
    kv_ids_BS: Array | None = None,
) -> Array:
    """Splash under context parallelism: this rank's two query chunks (global chunks
    `chunks` of 2 x cp, traced) against the whole sequence's K/V in position order. The
    kernel is built for the whole causal mask split into 2 x cp query shards
    (`q_seq_shards`); each chunk runs with its shard's slice of the mask's block tables,
    whose query offsets keep the mask causal by global position. q_ids_BT, kv_ids_BS: segment
    ids of this rank's queries and of all keys (document masking)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    chunk, n, s = q_BTNH.shape[1] // 2, q_BTNH.shape[2], k_BSKH.shape[1]
    block = splash_block(chunk)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = splash.MultiHeadMask([splash.CausalMask((s, s), shard_count=2 * cp)] * n)
    kernel = splash.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=2 * cp, interpret=interpret
    )
    heads_major = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    q = heads_major(q_BTNH * jnp.asarray(scale, q_BTNH.dtype))
    k, v = heads_major(k_BSKH), heads_major(v_BSKH)
    outs = []
    for i in range(2):
        part, rows = _query_shard(kernel, chunks[i], 2 * cp), slice(i * chunk, (i + 1) * chunk)
        if q_ids_BT is None:
            outs.append(jax.vmap(part)(q[:, :, rows], k, v))
        else:
            with_ids = lambda q, k, v, qi, ki, part=part: part(  # noqa: E731
                q, k, v, segment_ids=splash.SegmentIds(q=qi, kv=ki)
            )
            outs.append(jax.vmap(with_ids)(q[:, :, rows], k, v, q_ids_BT[:, rows], kv_ids_BS))
    return heads_major(jnp.concatenate(outs, axis=2))


def _query_shard(kernel: Any, shard: Array, n_shards: int) -> Any:
    """The splash kernel restricted to query shard `shard` of `n_shards` (traced): the slice
    of its block tables a shard_map over the query sequence would hand that shard
    (`SplashAttentionKernel.manual_sharding_spec`)."""

    def cut(x: Array | None, dim: int) -> Array | None:
        if x is None:
            return None
        size = x.shape[dim] // n_shards
        return jax.lax.dynamic_slice_in_dim(x, shard * size, size, dim)

    def cut_info(info: Any) -> Any:
        if info is None:
            return None
        return info._replace(
            data_next=cut(info.data_next, 1),
            mask_next=cut(info.mask_next, 1),
            block_mask=cut(info.block_mask, 1),
            q_sequence=cut(info.q_sequence, 0),
        )

    infos, kwargs = kernel.tree_flatten()
    return type(kernel).tree_unflatten(kwargs, [cut_info(i) for i in infos])


def _split_sequence_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    scale: float,
    backend: str,
    platform: str,
    split: SequenceSplit,
    segment_ids_BT: Array | None,
) -> Array:
    """This shard's queries against the whole sequence's K/V (and segment ids), gathered over
    the split (or, `split.method == "ring"`, passed around it: `ring_attention.py`)."""
    if split.method == "ring":
        if backend != "xla":
            raise ValueError(f"ring attention runs XLA blocks (model.attention=xla), not {backend}")
        return ring_attention(q_BTNH, k_BSKH, v_BSKH, scale, split, segment_ids_BT)
    t = q_BTNH.shape[1]
    k_BSKH, v_BSKH = split.gather(k_BSKH), split.gather(v_BSKH)
    kv_ids_BS = None if segment_ids_BT is None else split.gather(segment_ids_BT)
    if backend == "xla":
        return causal_gqa_attention(
            q_BTNH,
            k_BSKH,
            v_BSKH,
            scale,
            segment_ids_BT,
            split.positions(t),
            split.gathered_positions(t),
            kv_ids_BS,
        )
    if backend != "splash":
        raise ValueError(
            f"attention backend {backend!r} cannot run under context "
            f"parallelism; use one of {', '.join(CP_ATTENTION)}"
        )

    def kernel(q: Array, k: Array, v: Array, *ids: Array) -> Array:
        return splash_cp_attention(
            q, k, v, scale, split.degree, split.chunks(), platform != "tpu", *ids
        )

    k_BSKH, v_BSKH, kv_axes = kv_split_like_queries(
        split.in_position_order(k_BSKH), split.in_position_order(v_BSKH), q_BTNH.shape[2]
    )
    args = (q_BTNH, k_BSKH, v_BSKH)
    axes = (Q_AXES, kv_axes, kv_axes)
    if segment_ids_BT is not None and kv_ids_BS is not None:  # (both or neither)
        args += (segment_ids_BT, split.in_position_order(kv_ids_BS))
        axes += (("batch", "seq"), ("batch", "seq"))
    return run_per_shard(kernel, args, axes, Q_AXES)


def cudnn_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    scale: float,
    implementation: Literal["cudnn", "xla"] = "cudnn",
) -> Array:
    """cuDNN's fused causal attention; (B, T, N, H) layout and GQA are native to it.
    `implementation="xla"` runs the same call without cuDNN (tests check the arguments)."""
    return jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, scale=scale, is_causal=True, implementation=implementation
    )


def _kernel(backend: str, platform: str, scale: float) -> Callable[..., Array]:
    """The per-shard kernel: (q, k, v) -> out, for splash also (q, k, v, segment ids)."""
    if backend == "splash":
        interpret = platform != "tpu"
        return lambda q, k, v, *ids: splash_attention(q, k, v, scale, interpret, *ids)
    return functools.partial(cudnn_attention, scale=scale)


def attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    scale: float,
    backend: str,
    platform: str,
    segment_ids_BT: Array | None = None,
    q_start: Array | int | None = None,
) -> Array:
    """Causal GQA attention by `backend` (resolved: "xla" | "splash" | "cudnn"). The kernels
    run per device shard (`run_per_shard`); XLA's einsums are partitioned by the compiler.
    q_start: queries after a KV cache's first position (decoding: the xla path only).
    Under context parallelism (`sequence_split`) q holds this shard's tokens and K/V are
    gathered over the whole sequence first."""
    split = sequence_split()
    if split.degree > 1:
        return _split_sequence_attention(
            q_BTNH, k_BSKH, v_BSKH, scale, backend, platform, split, segment_ids_BT
        )
    if backend == "xla":
        if q_start is None:
            return causal_gqa_attention(q_BTNH, k_BSKH, v_BSKH, scale, segment_ids_BT)
        return causal_gqa_attention(
            q_BTNH,
            k_BSKH,
            v_BSKH,
            scale,
            segment_ids_BT,
            q_start + jnp.arange(q_BTNH.shape[1]),
            jnp.arange(k_BSKH.shape[1]),
        )
    if q_start is not None:
        raise ValueError(f"a KV cache (decoding) needs the xla attention, not {backend}")
    k_BSKH, v_BSKH, kv_axes = kv_split_like_queries(k_BSKH, v_BSKH, q_BTNH.shape[2])
    if segment_ids_BT is None:
        return run_per_shard(
            _kernel(backend, platform, scale),
            (q_BTNH, k_BSKH, v_BSKH),
            (Q_AXES, kv_axes, kv_axes),
            Q_AXES,
        )
    if backend != "splash":
        raise ValueError(
            f"segment ids (document masking) need the xla or splash attention, not {backend}"
        )
    return run_per_shard(
        _kernel(backend, platform, scale),
        (q_BTNH, k_BSKH, v_BSKH, segment_ids_BT),
        (Q_AXES, kv_axes, kv_axes, ("batch", "seq")),
        Q_AXES,
    )


def kv_split_like_queries(
    k_BSKH: Array, v_BSKH: Array, n_heads: int
) -> tuple[Array, Array, tuple[str, ...]]:
    """K/V for a per-shard kernel, and their logical axes. Where the query heads are split
    more ways than the K/V heads (a recipe keeps the K/V heads whole over tp:
    `parallelism.sharding_rules`), each shard's kernel would get its own query heads against
    every K/V head, a GQA grouping that is not the model's. So the K/V heads are repeated to
    lcm(K, split) and split like the query heads: each shard then holds exactly the K/V heads
    its query heads use (one, where the split is a multiple of K), in the model's grouping."""
    heads, kv_heads = split_degree("heads"), split_degree("kv_heads")
    if heads == kv_heads:
        return k_BSKH, v_BSKH, KV_AXES
    n_kv = k_BSKH.shape[2]
    repeat = math.lcm(n_kv, heads) // n_kv
    if kv_heads != 1 or n_heads % (n_kv * repeat):
        raise ValueError(
            f"{n_heads} query heads split {heads} ways and {n_kv} K/V heads split "
            f"{kv_heads} ways: a per-shard kernel needs the K/V heads split like "
            "the query heads, or whole"
        )
    expand = lambda x: jnp.repeat(x, repeat, axis=2)  # noqa: E731
    return expand(k_BSKH), expand(v_BSKH), Q_AXES
