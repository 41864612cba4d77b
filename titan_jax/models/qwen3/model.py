"""Qwen3 in Flax NNX: RMSNorm, rotate-half RoPE, GQA attention with per-head QK-norm, SwiGLU.

Numerics follow HF transformers' `Qwen3ForCausalLM` (and torchtitan's Qwen3): norms, RoPE tables
and softmax in fp32, everything else in the activation dtype. Every parameter declares its
logical axis names once (`logical_axes` metadata); `titan_jax.parallel` maps them to a mesh.
Weights are stored (in, out) and read through `use_param`, the hook where SimpleFSDP casts and
gathers them at use. Layers are stacked on a leading axis and run with `lax.scan`.
Activations are (B, T, D) with logical axes (batch, seq, embed); the layout is pinned through
`constrain` at the embedding output, the attention inputs, the MLP hidden and each block's
output. Kernels that prefer 2-D operands (`project`) flatten locally.

Init follows torchtitan HEAD (b5bcd76, `models/qwen3/__init__.py`): every linear and the
embedding ~ N(0, 0.02); for MoE flavours `wo` and the experts' `w2` use 0.02/sqrt(2*n_layers);
norm weights 1. Tied models read the embedding as the output projection.

Array names end in their dimensions, one letter each, with one meaning across `models/`,
`parallel/` and `train/loss.py`:
B batch, T sequence positions (queries), S key/value positions, D model dim (embed), N query
heads, K kv heads, G query heads per kv head (N / K), H head dim, F feed-forward hidden (per
expert in MoE), V vocab, L layers, E experts, R token rows (B*T flattened), C the experts each
token picks (top_k), M picks (R*C rows, one per (token, pick)), J chunks of token rows and I
token rows per chunk (the chunked loss).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from titan_jax.models.attention import KV_AXES, Q_AXES, attention
from titan_jax.models.embedding import vocab_lookup
from titan_jax.models.frozen_weights import IN_DIMS, QuantizedWeight
from titan_jax.models.lookahead import scan_with_lookahead
from titan_jax.models.lora import NO_LORA, Lora
from titan_jax.models.one_f_one_b import one_f_one_b_loss
from titan_jax.models.pipeline import pipeline_scan
from titan_jax.models.quantization import NONE, Quantization, QuantizedDot, dot
from titan_jax.models.qwen3.adapter import Adapter, adapter_beside
from titan_jax.models.qwen3.args import Qwen3Args, YarnScaling
from titan_jax.models.qwen3.moe import MOE_ROUTING, MOE_SAVED_ACTIVATIONS, MoE, router_aux_loss
from titan_jax.models.remat import LAYER_INPUT
from titan_jax.models.sharding_hooks import (
    GATHERED_PARAM,
    PipelineSplit,
    constrain,
    gather_layer,
    pipeline_split,
    pregathered,
    sequence_split,
    use_param,
)
from titan_jax.models.spec import HeadLoss

Array = jax.Array

# Names of the values the selective (and offload) activation-checkpoint policy saves: every
# matmul output and attention's output, as TorchTitan's op-level selective AC. What lies
# between them (norms, RoPE, SiLU * mul, residual adds) is recomputed in backward.
SAVED_ACTIVATIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "attn_out",
    "wo_out",
    "ffn_w1",
    "ffn_w3",
    "ffn_out",
    *MOE_SAVED_ACTIVATIONS,
)
# Names every remat mode saves (see `remat_policy`).
ALWAYS_SAVED = (MOE_ROUTING,)
KVPair = tuple[Array, Array]  # (keys, values) of a KV cache
# (weights, expert bias, KV cache, dropout key) of a layer, or of all of them stacked.
LayerInputs = tuple[nnx.State, Array | None, KVPair | None, Array | None]
LayerTables = tuple[Array, Array, Array | None]  # every layer's (cos, sin, segment ids)
# Logical axes of the activations the layout is pinned at (rules: titan_jax/parallel/rules.py).
ACT_AXES = ("batch", "seq", "embed")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Kernel and schedule choices, made for the target devices (build.py)."""

    expert_kernel: str = "looped"  # the MoE experts' SwiGLU (`moe.EXPERT_KERNELS`)
    attention: str = "xla"  # a resolved backend of `titan_jax/models/attention.py`
    platform: str = "cpu"  # of the target devices (splash runs interpreted off TPU)
    quantization: Quantization = NONE  # low-precision matmuls (`models/quantization.py`)
    expert_gather_before_router: bool = True  # `moe.MoE`'s w1 and w3, before routing


def _param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    std: float,
    n_in: int | None = None,
) -> nnx.Param:
    """A weight ~ N(0, std); a projection's names its `n_in` input dims (what a quantized
    LoRA base quantizes: `models/frozen_weights.py`)."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    if n_in is None:
        return nnx.Param(value, logical_axes=axes)
    metadata: dict[str, Any] = {IN_DIMS: tuple(range(n_in))}  # a Variable's free-form metadata
    return nnx.Param(value, logical_axes=axes, **metadata)


def _ones(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, jnp.float32), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis_name: str | None = "norm"):
        self.weight = _ones((dim,), (axis_name,))
        self.eps = eps

    @jax.named_scope("rms_norm")
    def __call__(self, x: Array) -> Array:
        # Statistics in fp32 even for bf16 activations; HF casts back before the weight multiply.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return use_param(self.weight, x.dtype) * normed.astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, yarn: YarnScaling | None = None) -> Array:
    """RoPE inverse frequencies (head_dim / 2,) in fp32, as HF computes them (its op order:
    the fp32 tables then match to the last bit), YaRN-scaled when `yarn` is given."""
    pos_freqs = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if yarn is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:  # the dim turning `rotations` times
        n = yarn.original_max_position_embeddings
        return head_dim * math.log(n / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # 1: keep the frequency (fast dims), 0: interpolate it (slow dims)
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def rope_tables(
    positions: Array, head_dim: int, theta: float, yarn: YarnScaling | None = None
) -> tuple[Array, Array]:
    """cos/sin tables (*positions.shape, head_dim) in fp32, rotate-half layout (halves repeated),
    times YaRN's attention factor when scaled (HF scales the tables, not the scores)."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_frequencies(head_dim, theta, yarn)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if yarn is None:
        return jnp.cos(emb), jnp.sin(emb)
    scale = yarn.cos_sin_scale
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


@jax.named_scope("rope")
def apply_rope(x_BTNH: Array, cos_TH: Array, sin_TH: Array) -> Array:
    """Rotates (..., heads, head_dim) by tables of shape (..., head_dim), HF's rotate-half."""
    half = x_BTNH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTNH[..., half:], x_BTNH[..., :half]], axis=-1)
    cos = jnp.expand_dims(cos_TH, -2).astype(x_BTNH.dtype)
    sin = jnp.expand_dims(sin_TH, -2).astype(x_BTNH.dtype)
    return x_BTNH * cos + rotated * sin


@jax.named_scope("project")
def project(
    x: Array,
    w: nnx.Param | QuantizedWeight,
    n_in: int,
    quantized: QuantizedDot | None = None,
    adapter: Adapter | None = None,
    dropout_key: Array | None = None,
) -> Array:
    """`x (..., *in) @ w (*in, *out) -> (..., *out)`, the weight read through the param hook;
    in low precision where `quantized` says (`models/quantization.py`); plus the LoRA
    `adapter`'s term where the projection has one (`models/lora.py`), its input under dropout
    with the layer's `dropout_key`.

    The leading (batch, seq) dims are merged into one row dim for the matmul: XLA:CPU runs it
    faster than with two batch-free leading dims (docs/notes/2026-12-03-cpu-train-step.md), and
    the merge is a free reshape on every backend. This is local to the kernel: callers see
    (B, T, ...) activations.
    With one in dim (q, k, v) the weight's out dims are merged too, a 2-D matmul: XLA:TPU
    (libtpu 0.0.50 to 0.0.52) rewrites the (rows, dim) x (dim, heads, head_dim) matmul into a
    convolution over the heads and aborts splitting its padded window on some meshes
    (`TransformWindow: split of a padded window dim`: 30B-A3B on v6e-32, 235B-A22B over
    fsdp512 on tpu7x-512), and XLA:CPU's backward of it spends more time transposing than
    multiplying. The contraction is unchanged, so are the numbers (merging `wo`'s two
    contracted dims would reorder its sums). The merged weight is named a gathered weight
    again, so remat treats it as the weight itself.
    """
    config = quantized.config if quantized is not None else None
    read_quantized = quantized.weight(n_in) if quantized else None
    w_ = use_param(w, x.dtype, read_quantized)
    lead, ins, outs = x.shape[: x.ndim - n_in], x.shape[x.ndim - n_in :], w_.shape[n_in:]
    rows = x.reshape(-1, *ins)
    if n_in == 1 and len(outs) > 1:
        w_ = checkpoint_name(w_.reshape(ins[0], math.prod(outs)), GATHERED_PARAM)
        y = dot(rows, w_, (((1,), (0,)), ((), ())), config).reshape(-1, *outs)
    else:
        contract = (tuple(range(1, n_in + 1)), tuple(range(n_in)))
        y = dot(rows, w_, (contract, ((), ())), config)
    if adapter is not None:
        y = y + adapter(rows, dropout_key)
    return y.reshape(*lead, *outs)


class Attention(nnx.Module):
    def __init__(self, args: Qwen3Args, rngs: nnx.Rngs, kernels: Kernels, lora: Lora = NO_LORA):
        d, n, k, h = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        wo_std = 0.02 / math.sqrt(2 * args.n_layers) if args.is_moe else 0.02
        self.wq = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), 0.02, 1)
        self.wk = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), 0.02, 1)
        self.wv = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), 0.02, 1)
        self.wo = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), wo_std, 2)
        self.wq_lora = adapter_beside(lora, "q_proj", self.wq, 1, rngs)
        self.wk_lora = adapter_beside(lora, "k_proj", self.wk, 1, rngs)
        self.wv_lora = adapter_beside(lora, "v_proj", self.wv, 1, rngs)
        self.wo_lora = adapter_beside(lora, "o_proj", self.wo, 2, rngs)
        self.q_norm = RMSNorm(h, args.norm_eps, "head_dim")
        self.k_norm = RMSNorm(h, args.norm_eps, "head_dim")
        self.n_rep = n // k
        self.scale = h**-0.5
        self.backend, self.platform = kernels.attention, kernels.platform
        self.quantization = kernels.quantization

    def __call__(
        self,
        x_BTD: Array,
        cos_TH: Array,
        sin_TH: Array,
        segment_ids_BT: Array | None = None,
        kv_cache: KVPair | None = None,
        start: Array | int = 0,
        dropout_key: Array | None = None,
    ) -> tuple[Array, KVPair | None]:
        """(output, the updated `kv_cache`). segment_ids_BT: attend only within equal ids
        (documents packed in one window). kv_cache: this layer's cached keys and values
        (B, S, K, H) each, for decoding: the tokens' own are written at positions start..,
        and the tokens attend to every cached position up to their own. dropout_key: the
        layer's LoRA dropout key (training)."""
        name = checkpoint_name
        qt = self.quantization.quantized_dot("attention")
        key = dropout_key
        q_BTNH = name(project(x_BTD, self.wq, 1, qt, self.wq_lora, key), "q_proj")
        k_BTKH = name(project(x_BTD, self.wk, 1, qt, self.wk_lora, key), "k_proj")
        v_BTKH = name(project(x_BTD, self.wv, 1, qt, self.wv_lora, key), "v_proj")
        # Qwen3: per-head RMSNorm on q and k, then RoPE.
        q_BTNH = constrain(apply_rope(self.q_norm(q_BTNH), cos_TH, sin_TH), Q_AXES)
        k_BTKH = constrain(apply_rope(self.k_norm(k_BTKH), cos_TH, sin_TH), KV_AXES)
        v_BTKH = constrain(v_BTKH, KV_AXES)
        q_start = None
        if kv_cache is not None:
            k_cache, v_cache = (
                jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), start, 1)
                for c, x in zip(kv_cache, (k_BTKH, v_BTKH), strict=True)
            )
            kv_cache = k_cache, v_cache
            (k_BTKH, v_BTKH), q_start = (c.astype(q_BTNH.dtype) for c in kv_cache), start
        with jax.named_scope("sdpa"):  # scaled dot-product attention, the op profiles name
            out_BTNH = attention(
                q_BTNH,
                k_BTKH,
                v_BTKH,
                self.scale,
                self.backend,
                self.platform,
                segment_ids_BT,
                q_start,
            )
        out_BTNH = name(out_BTNH, "attn_out")
        return name(project(out_BTNH, self.wo, 2, qt, self.wo_lora, key), "wo_out"), kv_cache


class FeedForward(nnx.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(
        self,
        args: Qwen3Args,
        rngs: nnx.Rngs,
        quantization: Quantization = NONE,
        lora: Lora = NO_LORA,
    ):
        d, f = args.dim, args.hidden_dim
        self.w1 = _param(rngs, (d, f), ("embed", "mlp"), 0.02, 1)
        self.w2 = _param(rngs, (f, d), ("mlp", "embed"), 0.02, 1)
        self.w3 = _param(rngs, (d, f), ("embed", "mlp"), 0.02, 1)
        self.w1_lora = adapter_beside(lora, "gate_proj", self.w1, 1, rngs)
        self.w2_lora = adapter_beside(lora, "down_proj", self.w2, 1, rngs)
        self.w3_lora = adapter_beside(lora, "up_proj", self.w3, 1, rngs)
        self.quantization = quantization

    def __call__(self, x_BTD: Array, dropout_key: Array | None = None) -> Array:
        name = checkpoint_name
        # The two matmul outputs are saved, not their product: SiLU's backward needs both,
        # and recomputing them would redo two of the block's seven matmuls.
        qt, key = self.quantization.quantized_dot("mlp"), dropout_key
        gate_BTF = name(project(x_BTD, self.w1, 1, qt, self.w1_lora, key), "ffn_w1")
        up_BTF = name(project(x_BTD, self.w3, 1, qt, self.w3_lora, key), "ffn_w3")
        with jax.named_scope("swiglu"):
            hidden_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("batch", "seq", "mlp"))
        return name(project(hidden_BTF, self.w2, 1, qt, self.w2_lora, key), "ffn_out")


class Block(nnx.Module):
    """Attention + SwiGLU feed-forward, or + routed experts (`moe`) for MoE flavours."""

    def __init__(self, args: Qwen3Args, rngs: nnx.Rngs, kernels: Kernels, lora: Lora = NO_LORA):
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, rngs, kernels, lora)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe:
            self.moe = MoE(
                args.dim,
                args.num_experts,
                args.moe_inter_dim,
                args.top_k,
                args.norm_topk_prob,
                0.02 / math.sqrt(2 * args.n_layers),
                kernels.expert_kernel,
                rngs,
                kernels.quantization,
                kernels.expert_gather_before_router,
                lora,
            )
        else:
            self.feed_forward = FeedForward(args, rngs, kernels.quantization, lora)

    def __call__(
        self,
        x_BTD: Array,
        cos_TH: Array,
        sin_TH: Array,
        expert_bias_E: Array | None = None,
        segment_ids_BT: Array | None = None,
        kv_cache: KVPair | None = None,
        start: Array | int = 0,
        dropout_key: Array | None = None,
    ) -> tuple[Array, dict[str, Array], KVPair | None]:
        """(output, the MoE router's statistics for MoE blocks (see `MoE`), else {}, the
        updated KV cache (see `Attention`)); `dropout_key`: the layer's LoRA dropout key."""
        with jax.named_scope("attention"):
            y_BTD, kv_cache = self.attention(
                self.attention_norm(x_BTD),
                cos_TH,
                sin_TH,
                segment_ids_BT,
                kv_cache,
                start,
                dropout_key,
            )
            x_BTD = x_BTD + y_BTD
        router = {}
        with jax.named_scope("feed_forward"):
            if expert_bias_E is None:
                x_BTD = x_BTD + self.feed_forward(self.ffn_norm(x_BTD), dropout_key)
            else:
                y_BTD, router = self.moe(self.ffn_norm(x_BTD), expert_bias_E)
                x_BTD = x_BTD + y_BTD
        return constrain(x_BTD, ACT_AXES), router, kv_cache


class Qwen3(nnx.Module):
    """Qwen3 decoder. `__call__(tokens_BT) -> logits_BTV` (fp32)."""

    def __init__(
        self, args: Qwen3Args, rngs: nnx.Rngs, kernels: Kernels = Kernels(), lora: Lora = NO_LORA
    ):
        """kernels: attention and MoE kernels, chosen for the target platform (build.py).
        lora: the projections that carry LoRA adapters (`models/lora.py`)."""
        args.validate()
        self.args = args
        self.tok_embeddings = _param(
            rngs, (args.vocab_size, args.dim), ("vocab", "vocab_embed"), 0.02
        )

        @nnx.split_rngs(splits=args.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(args, rngs, kernels, lora)

        # Stacked on a leading "layers" axis (see `stacked_logical_axes`).
        self.layers = make_layers(rngs)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        if not args.tie_embeddings:
            self.lm_head = _param(rngs, (args.dim, args.vocab_size), ("vocab_embed", "vocab"), 0.02)

    def hidden_states(
        self,
        tokens_BT: Array,
        dtype: jnp.dtype,
        remat: Callable | None = None,
        activation_stats: bool = False,
        expert_bias_LE: Array | None = None,
        kv_cache: KVPair | None = None,
        start: Array | int = 0,
        lookahead: bool = False,
        dropout_key: Array | None = None,
    ) -> tuple[Array, dict[str, Array], Array, KVPair | None]:
        """(final-normed hidden states (B, T, D) in `dtype`, aux stats, aux loss, the updated
        `kv_cache`).

        remat: the scanned block's `jax.checkpoint` policy (None: no remat).
        activation_stats: also return each layer's output sum of squares and element count
        (`activation_sq_sum`, `activation_count`), for per-layer RMS in the metrics.
        tokens_BT may be (B, T, 3): per token (id, segment id, RoPE position), for documents
        packed in a window (`training.document_mask`): attention stays within a segment.
        expert_bias_LE: MoE flavours' per-layer expert bias (zeros when None); then the stats
        hold each layer's tokens per expert (`tokens_per_expert`, (L, E)), and with
        `router_aux_loss_coef` > 0 the aux loss is HF's load-balancing loss times that
        coefficient, summed over this batch's tokens (the step divides by the token count).
        kv_cache: every layer's keys and values, (L, B, S, K, H) each, for decoding tokens at
        positions start.. (`decode.py`): written there, attended up to each token's own.
        lookahead: each layer's weights gathered a layer ahead, full remat (`lookahead.py`).
        dropout_key: LoRA dropout on the adapters' inputs (training), each layer's key split
        from it; None: no dropout.
        """
        x_BTD, tables, run_layer, (layers_state, expert_bias_LE, _, keys) = self._layer_inputs(
            tokens_BT, dtype, activation_stats, expert_bias_LE, start, dropout_key
        )
        split = pipeline_split()
        if split.degree > 1 and kv_cache is None:  # training and evaluation, not decoding
            scan = functools.partial(_pipelined_scan, remat=remat, split=split)
        elif lookahead and kv_cache is None:
            scan = functools.partial(_lookahead_scan, dtype=dtype)
        else:
            scan = functools.partial(_layer_scan, remat=remat)
        x_BTD, (stats, kv_cache) = scan(
            run_layer, x_BTD, (layers_state, expert_bias_LE, kv_cache, keys), tables
        )
        aux_loss = jnp.zeros((), jnp.float32)
        if self.args.is_moe:
            prob_sum = stats.pop("router_prob_sum")
            if self.args.router_aux_loss_coef > 0:
                n = tokens_BT.size
                aux_loss = (
                    self.args.router_aux_loss_coef
                    * n
                    * router_aux_loss(stats["tokens_per_expert"], prob_sum, n)
                )
        return self.norm(x_BTD), stats, aux_loss, kv_cache

    def _layer_inputs(
        self,
        tokens_BT: Array,
        dtype: jnp.dtype,
        activation_stats: bool,
        expert_bias_LE: Array | None,
        start: Array | int,
        dropout_key: Array | None,
    ) -> tuple[Array, LayerTables, Callable, LayerInputs]:
        """What the layer scans take (see `hidden_states`): the embedded tokens (B, T, D), the
        layers' (cos, sin, segment ids) tables, one layer's function and the stacked layers'
        inputs (state, expert bias, no KV cache, dropout keys)."""
        if self.args.is_moe and expert_bias_LE is None:
            expert_bias_LE = jnp.zeros((self.args.n_layers, self.args.num_experts), jnp.float32)
        t = tokens_BT.shape[1]
        # Global positions: under context parallelism this shard's tokens are two chunks.
        segment_ids_BT, positions = None, start + sequence_split().positions(t)
        if tokens_BT.ndim == 3:
            tokens_BT, segment_ids_BT, positions = (tokens_BT[..., i] for i in range(3))
        table_VD = use_param(self.tok_embeddings, dtype)
        with jax.named_scope("embed"):
            x_BTD = constrain(vocab_lookup(table_VD, tokens_BT, dtype), ACT_AXES)
        # Every layer's (cos, sin, segment ids): (T, H) tables, or (B, T, H) per token.
        tables = (
            *rope_tables(positions, self.args.head_dim, self.args.rope_theta, self.args.yarn),
            segment_ids_BT,
        )
        layers_def, layers_state = nnx.split(self.layers)
        layer_keys = (
            None if dropout_key is None else jax.random.split(dropout_key, self.args.n_layers)
        )

        def run_layer(
            x_BTD: Array,
            layer_state: nnx.State,
            expert_bias_E: Array | None,
            kv: KVPair | None,
            key: Array | None,
            tables: LayerTables,
        ) -> tuple[Array, tuple[dict[str, Array], KVPair | None]]:
            cos_TH, sin_TH, segment_ids_BT = tables
            y_BTD, stats, kv = nnx.merge(layers_def, layer_state)(
                x_BTD, cos_TH, sin_TH, expert_bias_E, segment_ids_BT, kv, start, key
            )
            if activation_stats:
                y32 = y_BTD.astype(jnp.float32)
                stats["activation_sq_sum"] = jnp.sum(y32 * y32)
                stats["activation_count"] = jnp.float32(y_BTD.size)
            return y_BTD, (stats, kv)

        return x_BTD, tables, run_layer, (layers_state, expert_bias_LE, None, layer_keys)

    def one_f_one_b_loss(
        self,
        tokens_BT: Array,
        labels_BT: Array,
        head_loss: HeadLoss,
        dtype: jnp.dtype,
        remat: Callable | None = None,
        activation_stats: bool = False,
        expert_bias_LE: Array | None = None,
        dropout_key: Array | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """(`head_loss` of the final-normed hidden states summed over the batch, aux stats), the
        layers run as the 1F1B pipeline (`models/one_f_one_b.py`): the final norm and the loss
        run per microbatch on the last stage. Arguments as `hidden_states`'; the MoE aux loss
        (a function of the whole batch's routing) cannot be split into microbatches."""
        if self.args.is_moe and self.args.router_aux_loss_coef > 0:
            raise ValueError("the 1F1B pipeline cannot take the router's aux loss")
        x_BTD, tables, run_layer, (layers_state, expert_bias_LE, _, keys) = self._layer_inputs(
            tokens_BT, dtype, activation_stats, expert_bias_LE, 0, dropout_key
        )

        def stage_scan(
            x_BTD: Array, layers: nnx.State, consts: tuple, tables: LayerTables
        ) -> tuple[Array, dict[str, Array]]:
            expert_bias_LE, keys = consts
            layer_inputs = (layers, expert_bias_LE, None, keys)
            y_BTD, (stats, _) = _layer_scan(run_layer, x_BTD, layer_inputs, tables, remat)
            return y_BTD, stats

        head_def, head_state = nnx.split((self.norm, self._output_param()))

        def head(y_BTD: Array, head_state: nnx.State, labels_BT: Array) -> Array:
            norm, output = nnx.merge(head_def, head_state)
            return head_loss(norm(y_BTD), self._output_weight(output, dtype), labels_BT)

        loss, stats = one_f_one_b_loss(
            stage_scan,
            head,
            x_BTD,
            layers_state,
            (expert_bias_LE, keys),
            tables,
            head_state,
            labels_BT,
            pipeline_split(),
        )
        stats.pop("router_prob_sum", None)
        return loss, stats

    def _output_param(self) -> nnx.Param:
        return self.tok_embeddings if self.args.tie_embeddings else self.lm_head

    def _output_weight(self, param: nnx.Param, dtype: jnp.dtype) -> Array:
        weight = use_param(param, dtype)
        return weight.T if self.args.tie_embeddings else weight

    def output_weight(self, dtype: jnp.dtype) -> Array:
        """The (D, V) output projection: lm_head, or the embedding transposed when tied."""
        return self._output_weight(self._output_param(), dtype)

    def __call__(self, tokens_BT: Array, dtype: DTypeLike = jnp.float32) -> Array:
        dtype = jnp.dtype(dtype)
        h_BTD, _, _, _ = self.hidden_states(tokens_BT, dtype)
        return jnp.einsum(
            "btd,dv->btv",
            h_BTD,
            self.output_weight(dtype).astype(dtype),
            preferred_element_type=jnp.float32,
        )


def _layer_scan(
    run_layer: Callable,
    x_BTD: Array,
    layers: LayerInputs,
    tables: LayerTables,
    remat: Callable | None,
) -> tuple[Array, tuple[dict[str, Array], KVPair | None]]:
    """`lax.scan` of `run_layer` over the stacked layers (and their expert bias, KV cache and
    dropout keys), each iteration's weights gathered in it, with the `remat` policy."""

    def body(
        x_BTD: Array, layer: LayerInputs
    ) -> tuple[Array, tuple[dict[str, Array], KVPair | None]]:
        # Every use of the input goes through the name, so a policy that offloads it leaves
        # the device nothing of it to save.
        return run_layer(checkpoint_name(x_BTD, LAYER_INPUT), *layer, tables)

    if remat is not None:
        body = jax.checkpoint(body, policy=remat, prevent_cse=False)
    return jax.lax.scan(body, x_BTD, layers)


def _pipelined_scan(
    run_layer: Callable,
    x_BTD: Array,
    layers: LayerInputs,
    tables: LayerTables,
    remat: Callable | None,
    split: PipelineSplit,
) -> tuple[Array, tuple[dict[str, Array], None]]:
    """The layer scan as `split`'s pipeline (`models/pipeline.py`): each stage's chunk of layers
    is a layer scan of its own, with the `remat` policy."""

    def chunk_scan(
        x_BTD: Array, chunk: LayerInputs, tables: LayerTables
    ) -> tuple[Array, dict[str, Array]]:
        y_BTD, (stats, _) = _layer_scan(run_layer, x_BTD, chunk, tables, remat)
        return y_BTD, stats

    x_BTD, stats = pipeline_scan(chunk_scan, x_BTD, layers, tables, split)
    return x_BTD, (stats, None)


def _lookahead_scan(
    run_layer: Callable,
    x_BTD: Array,
    layers: LayerInputs,
    tables: LayerTables,
    dtype: jnp.dtype,
) -> tuple[Array, tuple[dict[str, Array], None]]:
    """The layer scan with each layer's weights gathered (in `dtype`) one layer ahead, full
    remat (`models/lookahead.py`); no KV cache."""
    layers_state, expert_bias_LE, _, keys = layers

    def block(
        x_BTD: Array, gathered: nnx.State, per_layer: tuple[Any, Any], tables: LayerTables
    ) -> tuple[Array, tuple[dict[str, Array], None]]:
        with pregathered():
            expert_bias_E, key = per_layer
            return run_layer(x_BTD, gathered, expert_bias_E, None, key, tables)

    return scan_with_lookahead(
        block,
        functools.partial(gather_layer, dtype=dtype),
        x_BTD,
        layers_state,
        (expert_bias_LE, keys),
        tables,
    )


def stacked_logical_axes(
    path: tuple[str, ...], axes: tuple[str | None, ...]
) -> tuple[str | None, ...]:
    """Logical axes of a stored parameter: those under `layers` carry the stacked layer axis."""
    return ("layers", *axes) if path and path[0] == "layers" else axes
