"""Qwen3-MoE's feed-forward: a router with HF/TorchTitan semantics, dropless grouped experts,
and aux-loss-free load balancing.

Router (fp32, as TorchTitan HEAD): probabilities are the softmax of `x @ W_gate` over all
experts; experts are chosen by top-k of (probabilities + expert_bias); gate weights are the
*unbiased* probabilities of the chosen experts, renormalised when `norm_topk_prob`. The bias
only changes which experts are chosen, never the weights, and carries no gradient.

Experts (dropless): every (token, slot) pair is sorted by expert (stable), the rows are
gathered, three grouped matmuls run SwiGLU per expert, the results are un-sorted by the inverse
permutation (a gather, whose backward is a gather too, not a scatter-add) and summed over the
k slots in fp32, weighted by the gate weights. The picks go through the active expert dispatch
(`sharding_hooks.dispatch_to_experts`): local by default, an all-to-all over the `ep` mesh axis
under expert parallelism (`titan_jax/parallel/expert_parallel.py`), which only moves rows: the
routing and the weighted sum stay here.

Grouped matmul kernels (`GROUPED_SWIGLUS`), chosen by the target platform:
- "megablox": TPU, the Pallas megablox `gmm` (backward `gmm` + `tgmm`), the whole SwiGLU in one
  per-shard call (`models/qwen3/megablox.py`: why not `ragged_dot` there);
- "ragged": `jax.lax.ragged_dot`, a grouped-matmul kernel on GPU;
- "blocked": groups padded to blocks of `BLOCK` rows, each block multiplied by its expert's
  weight in one batched einsum. XLA:CPU runs `ragged_dot` like a masked dense matmul over every
  group (BENCHMARKS.md, "CPU kernel choices"); blocks run at dense speed plus at most one
  partial block per expert.
Both equal `dense_reference` (every expert on every token, masked), which is for tests only.

Balancing (TorchTitan's `load_balance_coeff`): the forward returns each expert's token count
(over all (token, slot) picks); the step sums them over microbatches and data shards and, after
the optimizer, moves each layer's bias by `coeff * sign(mean(counts) - counts)`, mean-centred
(`update_expert_bias`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from titan_jax.models.qwen3.megablox import megablox_swiglu
from titan_jax.models.sharding_hooks import dispatch_to_experts, use_param

Array = jax.Array
# The experts' matmul outputs, which selective activation checkpointing saves (model.py).
MOE_SAVED_ACTIVATIONS = ("moe_w1", "moe_w3", "moe_w2")
BLOCK = 64  # rows per block of the CPU grouped matmul


def route(x_RD: Array, gate_DE: Array, expert_bias_E: Array, top_k: int, norm_topk_prob: bool
          ) -> tuple[Array, Array, Array]:
    """(chosen experts (N, K) int32, gate weights (N, K) fp32, full probabilities (N, E))."""
    logits = jnp.dot(x_RD.astype(jnp.float32), gate_DE.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    _, experts = jax.lax.top_k(probs + jax.lax.stop_gradient(expert_bias_E), top_k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights, probs


def ragged_matmul(x_MD: Array, w_EDF: Array, group_sizes_E: Array) -> Array:
    return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E)


@jax.custom_vjp
def blocked_matmul(x_MD: Array, w_EDF: Array, group_sizes_E: Array) -> Array:
    """Rows of `x` sorted by group, times their group's weight, block by block. Rows past
    sum(group_sizes) (padding) are not computed; their output is zero.

    A custom VJP that saves only its inputs: the per-block weight copies (blocks x D x F,
    several times the expert weights) are remade in backward rather than kept per layer."""
    return _blocked(x_MD, w_EDF, group_sizes_E)


def _blocks(group_sizes_E: Array, m: int) -> tuple[Array, Array, int]:
    """(each row's place in the blocked layout (M,), one past the end for padding rows; each
    block's group (n_blocks,); n_blocks)."""
    e = group_sizes_E.shape[0]
    n_blocks = m // BLOCK + e  # sum_e ceil(size_e / BLOCK) never exceeds this
    starts = jnp.cumsum(group_sizes_E) - group_sizes_E
    padded_sizes = -(-group_sizes_E // BLOCK) * BLOCK
    padded_ends = jnp.cumsum(padded_sizes)
    row_group = jnp.repeat(jnp.arange(e), group_sizes_E, total_repeat_length=m)
    row_dest = (padded_ends - padded_sizes)[row_group] + jnp.arange(m) - starts[row_group]
    row_dest = jnp.where(jnp.arange(m) < jnp.sum(group_sizes_E), row_dest, n_blocks * BLOCK)
    # The group whose padded range holds each block (trailing spare blocks: the last group).
    # A comparison count rather than jnp.searchsorted, which fails inside shard_map.
    block_start = jnp.arange(n_blocks) * BLOCK
    block_group = jnp.minimum(jnp.sum(padded_ends[None, :] <= block_start[:, None], axis=1),
                              e - 1)
    return row_dest, block_group, n_blocks


def _to_blocks(x_MD: Array, row_dest: Array, n_blocks: int) -> Array:
    blocks = jnp.zeros((n_blocks * BLOCK, x_MD.shape[1]), x_MD.dtype).at[row_dest].set(
        x_MD, unique_indices=True, mode="drop")
    return blocks.reshape(n_blocks, BLOCK, -1)


def _from_blocks(blocks: Array, row_dest: Array) -> Array:
    flat = blocks.reshape(-1, blocks.shape[-1])
    return flat.at[row_dest].get(mode="fill", fill_value=0)


def _blocked(x_MD: Array, w_EDF: Array, group_sizes_E: Array) -> Array:
    row_dest, block_group, n_blocks = _blocks(group_sizes_E, x_MD.shape[0])
    out = jnp.einsum("nbd,ndf->nbf", _to_blocks(x_MD, row_dest, n_blocks), w_EDF[block_group])
    return _from_blocks(out, row_dest)


def _blocked_fwd(x_MD: Array, w_EDF: Array, group_sizes_E: Array
                 ) -> tuple[Array, tuple[Array, Array, Array]]:
    return _blocked(x_MD, w_EDF, group_sizes_E), (x_MD, w_EDF, group_sizes_E)


def _blocked_bwd(res: tuple[Array, Array, Array], g_MF: Array
                 ) -> tuple[Array, Array, np.ndarray]:
    x_MD, w_EDF, group_sizes_E = res
    row_dest, block_group, n_blocks = _blocks(group_sizes_E, x_MD.shape[0])
    g_blocks = _to_blocks(g_MF, row_dest, n_blocks)
    dx = _from_blocks(jnp.einsum("nbf,ndf->nbd", g_blocks, w_EDF[block_group]), row_dest)
    dw_blocks = jnp.einsum("nbd,nbf->ndf", _to_blocks(x_MD, row_dest, n_blocks), g_blocks)
    dw = jax.ops.segment_sum(dw_blocks, block_group, num_segments=w_EDF.shape[0])
    return dx, dw.astype(w_EDF.dtype), np.zeros(group_sizes_E.shape, jax.dtypes.float0)


blocked_matmul.defvjp(_blocked_fwd, _blocked_bwd)


GROUPED_MATMULS: dict[str, Callable[[Array, Array, Array], Array]] = {
    "ragged": ragged_matmul, "blocked": blocked_matmul}
GROUPED_SWIGLUS = ("megablox", *GROUPED_MATMULS)


def grouped_matmul_for(platform: str) -> str:
    return {"cpu": "blocked", "tpu": "megablox"}.get(platform, "ragged")


def expert_ffn(rows_MD: Array, experts_M: Array, w1_EDF: Array, w3_EDF: Array, w2_EFD: Array,
               grouped_matmul: str) -> Array:
    """Each row through its expert's SwiGLU (dropless): sorted by expert, grouped matmuls,
    un-sorted by the inverse permutation (a gather both ways, no scatter-add). Rows whose id
    is not an expert held here (>= the number of experts: padding of an exchange buffer) sort
    last, are left out of the group sizes, not computed, and come back zero."""
    order = jnp.argsort(experts_M, stable=True)
    group_sizes = jnp.bincount(experts_M, length=w1_EDF.shape[0]).astype(jnp.int32)
    if grouped_matmul == "megablox":  # TPU: the Pallas kernels, SwiGLU in one per-shard call
        swiglu = megablox_swiglu
    else:
        swiglu = functools.partial(grouped_swiglu, GROUPED_MATMULS[grouped_matmul])
    if grouped_matmul == "blocked":  # CPU: recompute the (rows, F) activations in backward
        swiglu = jax.checkpoint(swiglu, policy=jax.checkpoint_policies.nothing_saveable)
    y_MD = swiglu(rows_MD[order], w1_EDF, w3_EDF, w2_EFD, group_sizes)
    return y_MD[jnp.argsort(order)]


def grouped_swiglu(matmul: Callable[[Array, Array, Array], Array], x_MD: Array, w1_EDF: Array,
                   w3_EDF: Array, w2_EFD: Array, group_sizes_E: Array) -> Array:
    """Rows sorted by expert through their expert's SwiGLU, one grouped matmul per weight."""
    gate_MF = checkpoint_name(matmul(x_MD, w1_EDF, group_sizes_E), "moe_w1")
    up_MF = checkpoint_name(matmul(x_MD, w3_EDF, group_sizes_E), "moe_w3")
    return checkpoint_name(matmul(jax.nn.silu(gate_MF) * up_MF, w2_EFD, group_sizes_E),
                           "moe_w2")


def routed_experts(x_RD: Array, experts_RC: Array, weights_RC: Array, w1_EDF: Array,
                   w3_EDF: Array, w2_EFD: Array, grouped_matmul: str) -> Array:
    """sum_k weights[n, k] * SwiGLU_{experts[n, k]}(x[n]), dropless, in x's dtype. Each
    (token, slot) pick is one row through the active expert dispatch (local, or all-to-all
    under expert parallelism, where the weights are the experts held here); the k slots are
    summed in fp32, weighted by the gate."""
    def ffn(rows_MD: Array, experts_M: Array) -> Array:
        return expert_ffn(rows_MD, experts_M, w1_EDF, w3_EDF, w2_EFD, grouped_matmul)

    n, k = experts_RC.shape
    rows_MD = x_RD[jnp.arange(n * k) // k]
    y_MD = dispatch_to_experts(rows_MD, experts_RC.reshape(-1), w1_EDF.shape[0], ffn)
    y_RCD = y_MD.reshape(n, k, -1).astype(jnp.float32)
    return jnp.einsum("rc,rcd->rd", weights_RC, y_RCD).astype(x_RD.dtype)


def dense_reference(x_RD: Array, experts_RC: Array, weights_RC: Array, w1_EDF: Array,
                    w3_EDF: Array, w2_EFD: Array) -> Array:
    """Every expert on every token, weighted by the (mostly zero) gate: tests only."""
    gate_RE = jnp.zeros((x_RD.shape[0], w1_EDF.shape[0]), jnp.float32)
    gate_RE = gate_RE.at[jnp.arange(x_RD.shape[0])[:, None], experts_RC].add(weights_RC)
    hidden = jax.nn.silu(jnp.einsum("nd,edf->enf", x_RD, w1_EDF)) * jnp.einsum(
        "nd,edf->enf", x_RD, w3_EDF)
    y_ERD = jnp.einsum("enf,efd->end", hidden, w2_EFD)
    return jnp.einsum("ne,end->nd", gate_RE, y_ERD.astype(jnp.float32)).astype(x_RD.dtype)


def update_expert_bias(bias_LE: Array, counts_LE: Array, coeff: float) -> Array:
    """TorchTitan's aux-loss-free step: under-loaded experts up, over-loaded down, centred."""
    delta = coeff * jnp.sign(jnp.mean(counts_LE, axis=-1, keepdims=True) - counts_LE)
    return bias_LE + delta - jnp.mean(delta, axis=-1, keepdims=True)


class MoE(nnx.Module):
    """Router + routed SwiGLU experts.

    `__call__(x_BTD, expert_bias_E) -> (y_BTD, {"tokens_per_expert": (E,) picks, no gradient;
    "router_prob_sum": (E,) summed router probabilities, with gradient (HF's aux loss)})`."""

    def __init__(self, dim: int, num_experts: int, inter_dim: int, top_k: int,
                 norm_topk_prob: bool, w2_std: float, grouped_matmul: str, rngs: nnx.Rngs):
        def param(shape: tuple[int, ...], axes: tuple[str | None, ...], std: float
                  ) -> nnx.Param:
            return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32),
                             logical_axes=axes)

        e, d, f = num_experts, dim, inter_dim
        self.gate = param((d, e), ("embed", None), 0.02)
        # "moe_embed": the experts' model dim, FSDP-split apart from `ep`, which splits experts.
        self.w1 = param((e, d, f), ("expert", "moe_embed", "mlp"), 0.02)
        self.w3 = param((e, d, f), ("expert", "moe_embed", "mlp"), 0.02)
        self.w2 = param((e, f, d), ("expert", "mlp", "moe_embed"), w2_std)
        self.num_experts, self.top_k, self.norm_topk_prob = e, top_k, norm_topk_prob
        self.grouped_matmul = grouped_matmul

    def __call__(self, x_BTD: Array, expert_bias_E: Array) -> tuple[Array, dict[str, Array]]:
        x_RD = x_BTD.reshape(-1, x_BTD.shape[-1])
        experts, weights, probs = route(x_RD, use_param(self.gate, jnp.float32), expert_bias_E,
                                        self.top_k, self.norm_topk_prob)
        dtype = x_BTD.dtype
        y_RD = routed_experts(x_RD, experts, weights, use_param(self.w1, dtype),
                              use_param(self.w3, dtype), use_param(self.w2, dtype),
                              self.grouped_matmul)
        counts = jnp.bincount(experts.reshape(-1), length=self.num_experts)
        return y_RD.reshape(x_BTD.shape), {
            "tokens_per_expert": jax.lax.stop_gradient(counts.astype(jnp.float32)),
            "router_prob_sum": jnp.sum(probs, axis=0)}


def router_aux_loss(tokens_per_expert_LE: Array, router_prob_sum_LE: Array, n_tokens: int
                    ) -> Array:
    """HF's `load_balancing_loss_func` over all layers of one batch: E * sum_e f_e * P_e, with
    f_e the share of (token, layer) pairs whose top-k picked e and P_e the mean router
    probability of e (gradient through P only). Balanced routing gives top_k."""
    layers, experts = tokens_per_expert_LE.shape
    pairs = layers * n_tokens
    f_E = jnp.sum(tokens_per_expert_LE, axis=0) / pairs
    p_E = jnp.sum(router_prob_sum_LE, axis=0) / pairs
    return experts * jnp.sum(f_E * p_E)
