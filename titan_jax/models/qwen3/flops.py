"""Analytic parameter and FLOP counts of a Qwen3 model (dense or MoE), for MFU."""

from __future__ import annotations

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


def flops_per_token(args: Qwen3Args, seq_len: int) -> float:
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
    """
    counts = count_params(args)
    n = counts["active"] - (0 if args.tie_embeddings else counts["embedding"])
    return float(6 * n + 6 * args.n_layers * args.n_heads * (2 * args.head_dim) * seq_len)
