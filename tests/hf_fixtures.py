"""A random HF transformers Qwen3 model for the tests that compare against it."""

from titan_jax.models.qwen3 import Qwen3Args, hf_config


def random_hf_model(args: Qwen3Args, seed: int = 0):
    """A transformers Qwen3ForCausalLM with random weights, norms included (init makes them 1,
    which would hide a norm mapped to the wrong place)."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
        tie_word_embeddings=args.tie_embeddings, rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len,
        rope_parameters=hf_config.hf_config_from_args(args)["rope_parameters"])
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.eval()
