"""A random HF transformers Qwen3 model for the tests that compare against it."""

from titan_jax.models.qwen3 import Qwen3Args, hf_config


def random_hf_model(args: Qwen3Args, seed: int = 0):
    """A transformers Qwen3ForCausalLM with random weights, norms included (init makes them 1,
    which would hide a norm mapped to the wrong place)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        tie_word_embeddings=args.tie_embeddings,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len,
        rope_parameters=hf_config.hf_config_from_args(args)["rope_parameters"],
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.eval()


def random_hf_moe_model(seq_len: int, norm_topk_prob: bool = True, seed: int = 0):
    """A small transformers Qwen3MoeForCausalLM (8 experts, top 2, 2 layers, aux loss off) with
    random norms and weights 4x their init, so routing is decided by clear margins."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        output_router_logits=False,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms away from 1, so a misplaced one shows
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:  # larger than init so routing is decided by clear margins
                p.mul_(4.0)
    return model
