"""Qwen3-MoE's feed-forward: a router with HF/TorchTitan semantics, dropless grouped experts,
and aux-loss-free load balancing.

Router (fp32, as TorchTitan HEAD): probabilities are the softmax of `x @ W_gate` over all
experts; experts are chosen by top-k of (probabilities + expert_bias); gate weights are the
*unbiased* probabilities of the chosen experts, renormalised when `norm_topk_prob`. The bias
only changes which experts are chosen, never the weights, and carries no gradient.

Experts (dropless): every (token, slot) pair is sorted by expert (stable), the rows are
gathered, three grouped matmuls run SwiGLU per expert, each output is scaled by its gate weight
where it is computed, and the results are un-sorted by the inverse permutation (a gather,
whose backward is a gather too, not a scatter-add) and summed over the k slots in fp32. The
picks go through the active expert dispatch (`sharding_hooks.dispatch_to_experts`): local by
default, an all-to-all over the `ep` mesh axis under expert parallelism
(`titan_jax/parallel/expert_parallel.py`), which moves rows and their gate weights: the routing
and the sum over slots stay here.

Expert kernels (`EXPERT_KERNELS`: the SwiGLU of rows sorted by expert), chosen by the target
platform:
- "megablox" (TPU): the Pallas megablox `gmm` (backward `gmm` + `tgmm`), the whole SwiGLU in one
  per-shard call (`megablox.py`: why not `ragged_dot` there);
- "ragged" (GPU): three `jax.lax.ragged_dot` grouped matmuls;
- "looped" (CPU): one loop over blocks of each expert's rows, the whole SwiGLU per block against
  the expert's weights in place (`looped_experts.py`). XLA:CPU runs `ragged_dot` like a masked
  dense matmul over every group (docs/notes/2026-12-03-cpu-train-step.md).
All equal `dense_reference` (every expert on every token, masked), which is for tests only.

Balancing (TorchTitan's `load_balance_coeff`): the forward returns each expert's token count
(over all (token, slot) picks); the step sums them over microbatches and data shards and, after
the optimizer, moves each layer's bias by `coeff * sign(mean(counts) - counts)`, mean-centred
(`update_expert_bias`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from titan_jax.models.frozen_weights import IN_DIMS
from titan_jax.models.lora import NO_LORA, Lora
from titan_jax.models.permutation import permute
from titan_jax.models.quantization import NONE, Quantization, ragged_dot
from titan_jax.models.qwen3.adapter import (
    AdaptedExperts,
    adapted_matmul,
    adapted_matmul_pair,
    adapter_beside,
    through_once,
)
from titan_jax.models.qwen3.looped_experts import looped_swiglu
from titan_jax.models.qwen3.megablox import ExpertWeight, megablox_swiglu
from titan_jax.models.sharding_hooks import dispatch_to_experts, split_degree, use_param

Array = jax.Array
# The experts' matmul outputs, which selective activation checkpointing saves (model.py).
MOE_SAVED_ACTIVATIONS = ("moe_w1", "moe_w3", "moe_w2")
# The router's picks and gate weights (top_k numbers a token), which every remat mode saves:
# the backward's first exchange (the output's gradient to the experts) needs only them, and
# recomputed, it would wait for the recomputed router and what the compiler fuses with it
# (2-layer 235B program: that exchange 17% covered by compute, saved 100%; docs/MOE.md).
MOE_ROUTING = "moe_routing"
ROUTER_DTYPE = jnp.float32  # the router reads its weight in fp32 (TorchTitan, HF)
# The experts' LoRA targets, named as PEFT's `target_parameters` end (transformers' fused
# `mlp.experts.gate_up_proj` (w1 and w3: one joined adapter) and `mlp.experts.down_proj`).
GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"


@jax.named_scope("router")
def route(
    x_RD: Array, gate_DE: Array, expert_bias_E: Array, top_k: int, norm_topk_prob: bool
) -> tuple[Array, Array, Array]:
    """(chosen experts (N, K) int32, gate weights (N, K) fp32, full probabilities (N, E))."""
    logits = jnp.dot(x_RD.astype(jnp.float32), gate_DE.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    _, experts = jax.lax.top_k(probs + jax.lax.stop_gradient(expert_bias_E), top_k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights, probs


def grouped_swiglu(
    matmul: Callable[[Array, Any, Array], Array],
    x_MD: Array,
    w1_EDF: ExpertWeight,
    w3_EDF: ExpertWeight,
    w2_EFD: ExpertWeight,
    group_sizes_E: Array,
) -> Array:
    """Rows sorted by expert through their expert's SwiGLU, one grouped matmul per weight (its
    LoRA adapter's in `ragged_dot`, unquantized)."""
    matmuls = (matmul, *(functools.partial(ragged_dot, config=None),) * 2)
    gate_MF, up_MF = adapted_matmul_pair(matmuls, x_MD, (w1_EDF, w3_EDF), group_sizes_E)
    h_MF = jax.nn.silu(checkpoint_name(gate_MF, "moe_w1")) * checkpoint_name(up_MF, "moe_w3")
    return checkpoint_name(adapted_matmul(*matmuls, h_MF, w2_EFD, group_sizes_E), "moe_w2")


def folded_looped_swiglu(
    x_MD: Array,
    w1_EDF: Array | AdaptedExperts,
    w3_EDF: Array | AdaptedExperts,
    w2_EFD: Array | AdaptedExperts,
    group_sizes_E: Array,
) -> Array:
    """The CPU kernel, which takes plain weights: LoRA adapters folded into theirs."""

    def plain(w: Array | AdaptedExperts) -> Array:
        return w.folded() if isinstance(w, AdaptedExperts) else w

    return looped_swiglu(x_MD, plain(w1_EDF), plain(w3_EDF), plain(w2_EFD), group_sizes_E)


# (rows sorted by expert (M, D), w1, w3, w2, group sizes (E,)) -> each row's SwiGLU (M, D).
EXPERT_KERNELS: dict[str, Callable[..., Array]] = {
    "ragged": functools.partial(grouped_swiglu, functools.partial(ragged_dot, config=None)),
    "looped": folded_looped_swiglu,
    "megablox": megablox_swiglu,
}


def expert_kernel_for(platform: str, quantization: Quantization = NONE) -> str:
    """The platform's kernel; on CPU, `ragged` (qwix's quantized `ragged_dot`) where the
    experts are quantized (the looped kernel takes no low-precision operands)."""
    if platform == "cpu" and quantization.applies_to("experts"):
        return "ragged"
    return {"cpu": "looped", "tpu": "megablox"}.get(platform, "ragged")


def expert_kernel(kernel: str, quantization: Quantization) -> Callable[..., Array]:
    """`kernel`'s SwiGLU, on quantized operands where `quantization` covers the experts:
    qwix's `ragged_dot` (CPU, GPU), tokamax's grouped matmul (TPU)."""
    if not quantization.applies_to("experts"):
        return EXPERT_KERNELS[kernel]
    if kernel == "megablox":
        return functools.partial(megablox_swiglu, qdtype=quantization.kernel_qtype())
    return functools.partial(
        grouped_swiglu, functools.partial(ragged_dot, config=quantization.ragged_config())
    )


def expert_ffn(
    rows_MD: Array,
    experts_M: Array,
    w1_EDF: ExpertWeight,
    w3_EDF: ExpertWeight,
    w2_EFD: ExpertWeight,
    kernel: str,
    quantization: Quantization = NONE,
) -> Array:
    """Each row through its expert's SwiGLU (dropless): sorted by expert, the grouped kernel,
    un-sorted by the inverse permutation (a gather both ways, no scatter-add). Rows whose id
    is not an expert held here (>= the number of experts: padding of an exchange buffer) sort
    last, are left out of the group sizes, not computed, and come back zero."""
    order = jnp.argsort(experts_M, stable=True)
    inverse = jnp.argsort(order)
    group_sizes = jnp.bincount(experts_M, length=w1_EDF.shape[0]).astype(jnp.int32)
    with jax.named_scope("experts"):
        y_MD = expert_kernel(kernel, quantization)(
            permute(rows_MD, order, inverse), w1_EDF, w3_EDF, w2_EFD, group_sizes
        )
    return permute(y_MD, inverse, order)


def routed_experts(
    x_RD: Array,
    experts_RC: Array,
    weights_RC: Array,
    w1_EDF: ExpertWeight,
    w3_EDF: ExpertWeight,
    w2_EFD: ExpertWeight,
    expert_kernel: str,
    quantization: Quantization = NONE,
) -> Array:
    """sum_k weights[n, k] * SwiGLU_{experts[n, k]}(x[n]), dropless, in x's dtype. Each
    (token, slot) pick is one row through the active expert dispatch (local, or all-to-all
    under expert parallelism, where the weights are the experts held here), its output scaled
    by its gate weight in fp32 where the experts compute it and cast to x's dtype (as
    TorchTitan's and HF's); the k slots are summed in fp32."""

    def ffn(rows_MD: Array, experts_M: Array, gates_M: Array) -> Array:
        y_MD = expert_ffn(rows_MD, experts_M, w1_EDF, w3_EDF, w2_EFD, expert_kernel, quantization)
        return (y_MD.astype(jnp.float32) * gates_M[:, None]).astype(y_MD.dtype)

    n, k = experts_RC.shape
    with jax.named_scope("moe_permute"):  # the picks' copies, sorts, exchange and sum
        # each token's row k times (a broadcast: its gradient is a sum over k, no scatter-add)
        rows_MD = jnp.broadcast_to(x_RD[:, None], (n, k, x_RD.shape[-1])).reshape(n * k, -1)
        y_MD = dispatch_to_experts(
            rows_MD, experts_RC.reshape(-1), weights_RC.reshape(-1), w1_EDF.shape[0], ffn
        )
        return jnp.sum(y_MD.reshape(n, k, -1).astype(jnp.float32), axis=1).astype(x_RD.dtype)


def dense_reference(
    x_RD: Array, experts_RC: Array, weights_RC: Array, w1_EDF: Array, w3_EDF: Array, w2_EFD: Array
) -> Array:
    """Every expert on every token, weighted by the (mostly zero) gate: tests only."""
    gate_RE = jnp.zeros((x_RD.shape[0], w1_EDF.shape[0]), jnp.float32)
    gate_RE = gate_RE.at[jnp.arange(x_RD.shape[0])[:, None], experts_RC].add(weights_RC)
    hidden = jax.nn.silu(jnp.einsum("nd,edf->enf", x_RD, w1_EDF)) * jnp.einsum(
        "nd,edf->enf", x_RD, w3_EDF
    )
    y_ERD = jnp.einsum("enf,efd->end", hidden, w2_EFD)
    return jnp.einsum("ne,end->nd", gate_RE, y_ERD.astype(jnp.float32)).astype(x_RD.dtype)


def update_expert_bias(bias_LE: Array, counts_LE: Array, coeff: float) -> Array:
    """TorchTitan's aux-loss-free step: under-loaded experts up, over-loaded down, centred."""
    delta = coeff * jnp.sign(jnp.mean(counts_LE, axis=-1, keepdims=True) - counts_LE)
    return bias_LE + delta - jnp.mean(delta, axis=-1, keepdims=True)


class MoE(nnx.Module):
    """Router + routed SwiGLU experts, with LoRA adapters per expert where `lora` targets
    them, run beside the expert weights (`adapter.py`).

    `__call__(x_BTD, expert_bias_E) -> (y_BTD, {"tokens_per_expert": (E,) picks, no gradient;
    "router_prob_sum": (E,) summed router probabilities, with gradient (HF's aux loss)})`."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        inter_dim: int,
        top_k: int,
        norm_topk_prob: bool,
        w2_std: float,
        expert_kernel: str,
        rngs: nnx.Rngs,
        quantization: Quantization = NONE,
        gather_before_router: bool = True,
        lora: Lora = NO_LORA,
    ):
        def param(
            shape: tuple[int, ...], axes: tuple[str | None, ...], std: float, **metadata: Any
        ) -> nnx.Param:
            return nnx.Param(
                std * jax.random.normal(rngs.params(), shape, jnp.float32),
                logical_axes=axes,
                **metadata,
            )

        e, d, f = num_experts, dim, inter_dim
        # `read_dtype`: the look-ahead gather (models/lookahead.py) reads it as the router does.
        self.gate = param((d, e), ("embed", None), 0.02, read_dtype=ROUTER_DTYPE)
        # "moe_embed": the experts' model dim, FSDP-split apart from `ep`, which splits experts.
        # `IN_DIMS`: each expert's input dim (what a quantized LoRA base quantizes over).
        self.w1 = param((e, d, f), ("expert", "moe_embed", "mlp"), 0.02, **{IN_DIMS: (1,)})
        self.w3 = param((e, d, f), ("expert", "moe_embed", "mlp"), 0.02, **{IN_DIMS: (1,)})
        self.w2 = param((e, f, d), ("expert", "mlp", "moe_embed"), w2_std, **{IN_DIMS: (1,)})
        self.w1_and_w3_lora = adapter_beside(lora, GATE_UP, (self.w1, self.w3), 1, rngs, 1)
        self.w2_lora = adapter_beside(lora, DOWN, self.w2, 1, rngs, 1)
        self.num_experts, self.top_k, self.norm_topk_prob = e, top_k, norm_topk_prob
        self.expert_kernel, self.quantization = expert_kernel, quantization
        self.gather_before_router = gather_before_router

    def __call__(self, x_BTD: Array, expert_bias_E: Array) -> tuple[Array, dict[str, Array]]:
        x_RD = x_BTD.reshape(-1, x_BTD.shape[-1])
        dtype = x_BTD.dtype
        # Where FSDP gathers them, the experts arrive as codes when the kernel reads them
        # quantized (`Quantization.expert_weight`); beside a LoRA adapter, in the compute dtype
        # (the CPU kernel folds the adapter into them: codes take no sum).
        read = self.quantization.expert_weight(self.expert_kernel, split_degree("mlp"))
        w1_EDF: ExpertWeight
        w3_EDF: ExpertWeight
        if self.w1_and_w3_lora is None:
            w1_EDF, w3_EDF = use_param(self.w1, dtype, read), use_param(self.w3, dtype, read)
        else:
            w1_EDF, w3_EDF = self.w1_and_w3_lora.beside_experts(
                use_param(self.w1, dtype), use_param(self.w3, dtype)
            )
        if self.gather_before_router:
            # w1 and w3 (cast, FSDP-gathered) tied to the input, so gathered before the router:
            # XLA:TPU runs the FSDP all-gathers on the SparseCores one at a time, in schedule
            # order, and the dispatch's row permutations run there too. Gathered at its use, the
            # first waited behind those with little compute left to hide under (7% covered on
            # the 2-layer 235B-A22B v5p-256 program); tied, both gather under the attention
            # (docs/MOE.md). w2, used last, gathers under their matmuls.
            # (A joined adapter's A goes through once: `adapted_matmul_pair` shares its x A.)
            x_RD, w1_EDF, w3_EDF = through_once(
                jax.lax.optimization_barrier, (x_RD, w1_EDF, w3_EDF)
            )
        experts, weights, probs = route(
            x_RD, use_param(self.gate, ROUTER_DTYPE), expert_bias_E, self.top_k, self.norm_topk_prob
        )
        experts, weights = checkpoint_name((experts, weights), MOE_ROUTING)
        w2_EFD: ExpertWeight
        if self.w2_lora is None:
            w2_EFD = use_param(self.w2, dtype, read)
        else:
            (w2_EFD,) = self.w2_lora.beside_experts(use_param(self.w2, dtype))
        y_RD = routed_experts(
            x_RD, experts, weights, w1_EDF, w3_EDF, w2_EFD, self.expert_kernel, self.quantization
        )
        counts = jnp.bincount(experts.reshape(-1), length=self.num_experts)
        return y_RD.reshape(x_BTD.shape), {
            "tokens_per_expert": jax.lax.stop_gradient(counts.astype(jnp.float32)),
            "router_prob_sum": jnp.sum(probs, axis=0),
        }


def router_aux_loss(tokens_per_expert_LE: Array, router_prob_sum_LE: Array, n_tokens: int) -> Array:
    """HF's `load_balancing_loss_func` over all layers of one batch: E * sum_e f_e * P_e, with
    f_e the share of (token, layer) pairs whose top-k picked e and P_e the mean router
    probability of e (gradient through P only). Balanced routing gives top_k."""
    layers, experts = tokens_per_expert_LE.shape
    pairs = layers * n_tokens
    f_E = jnp.sum(tokens_per_expert_LE, axis=0) / pairs
    p_E = jnp.sum(router_prob_sum_LE, axis=0) / pairs
    return experts * jnp.sum(f_E * p_E)
