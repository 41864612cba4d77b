"""Analytic parameter and FLOP counts of a Qwen3 model (dense or MoE), for MFU."""

from __future__ import annotations

from titan_jax.models.lora import NO_LORA, Lora
from titan_jax.models.qwen3.args import Qwen3Args


def count_params(args: Qwen3Args) -> dict[str, int]:
    """Analytic parameter counts of a Qwen3 model.

    `total`: every trainable parameter, the embedding counted once when tied (as HF reports).
    `embedding`: the token embedding matrix (vocab, dim).
    `active`: parameters one token uses: like `total` but each MoE layer's experts scaled by
    top_k/num_experts (the router counts in full). Equal to `total` for a dense model.
    The MoE expert-bias is a load-balancing buffer updated outside the optimizer: not counted.
    """
    d, v = args.dim, args.vocab_size
    embedding = v * d
    attention = 2 * d * args.q_dim + 2 * d * args.kv_dim + 2 * args.head_dim  # + q/k norms
    norms = 2 * d  # attention_norm, ffn_norm
    if args.is_moe:
        router = d * args.num_experts
        experts = 3 * args.num_experts * d * args.moe_inter_dim
        ffn_total = router + experts
        # Exact: experts is a multiple of num_experts (torchtitan's integer division agrees).
        ffn_active = router + experts * args.top_k // args.num_experts
    else:
        ffn_total = ffn_active = 3 * d * args.hidden_dim
    lm_head = 0 if args.tie_embeddings else v * d
    outside_layers = embedding + lm_head + d  # + final norm
    total = outside_layers + args.n_layers * (attention + norms + ffn_total)
    active = outside_layers + args.n_layers * (attention + norms + ffn_active)
    return {"total": total, "embedding": embedding, "active": active}


def adapter_params(args: Qwen3Args, lora: Lora) -> dict[str, int]:
    """The LoRA adapters' parameter counts (A: in x r, B: r x out per adapted weight):
    `total`, and `active`, those one token uses (an expert's adapters only where the token is
    routed: top_k of num_experts)."""
    r, d = lora.rank, args.dim
    dense = {
        "q_proj": (d, args.q_dim),
        "k_proj": (d, args.kv_dim),
        "v_proj": (d, args.kv_dim),
        "o_proj": (args.q_dim, d),
        "gate_proj": (d, args.hidden_dim),
        "up_proj": (d, args.hidden_dim),
        "down_proj": (args.hidden_dim, d),
    }
    experts = {
        "experts.gate_up_proj": (d, 2 * args.moe_inter_dim),  # one adapter on both
        "experts.down_proj": (args.moe_inter_dim, d),
    }
    per_layer = sum(r * (i + o) for p, (i, o) in dense.items() if lora.targets(p))
    per_expert = sum(
        r * (i + o) for p, (i, o) in experts.items() if args.is_moe and lora.targets(p)
    )
    total = args.n_layers * (per_layer + per_expert * args.num_experts)
    active = args.n_layers * (per_layer + per_expert * args.top_k)
    return {"total": total, "active": active}


def flops_per_token(args: Qwen3Args, seq_len: int, lora: Lora = NO_LORA) -> float:
    """Training FLOPs per token (forward + backward), TorchTitan's MFU numerator.

    `6 * N + 6 * n_layers * n_heads * (2 * head_dim) * seq_len`, as in torchtitan 0.3.0
    `torchtitan/models/utils.py::get_moe_model_nparams_and_flops` (Qwen3 uses it for dense and
    MoE flavours, with head_dims = 2 * head_dim). N is `count_params(args)["active"]` minus the
    embedding when untied; when tied the shared matrix is the lm_head matmul and stays in N.
    So N counts every parameter used per token: attention and FFN projections, the MoE router in
    full, routed experts scaled by top_k/num_experts, the lm_head, and also the RMSNorm weights
    (as TorchTitan does; they are ~0.01% of N). The second term is the attention score and value
    matmuls over the full sequence (causal sparsity ignored, flash-attention recompute not
    counted).

    With LoRA (`lora`), the frozen base needs no weight gradients: 4 FLOPs a parameter per
    token (forward, and the input gradient backward) instead of 6, and the adapters 6 each.
    Folding an expert adapter into its weights at use (models/lora.py) is not counted, as
    remat's recompute is not.
    """
    counts = count_params(args)
    n = counts["active"] - (0 if args.tie_embeddings else counts["embedding"])
    attention = 6 * args.n_layers * args.n_heads * (2 * args.head_dim) * seq_len
    if lora.rank == 0:
        return float(6 * n + attention)
    return float(4 * n + 6 * adapter_params(args, lora)["active"] + attention)
