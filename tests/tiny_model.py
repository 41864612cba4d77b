"""The tiny Qwen3 most tests train: every code path of the real model at a glance's cost."""

from titan_jax.models.qwen3 import Qwen3Args

# GQA 2, two stacked layers; the vocabulary fits the shipped tokenizer (2048 tokens).
TINY = Qwen3Args(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=64,
    vocab_size=2048,
    max_seq_len=64,
)
# Two shapes for the HF and decoding comparisons: an untied GQA model whose head_dim differs
# from dim / n_heads, and a tied MHA model with a non-default RoPE theta and norm eps.
UNTIED = Qwen3Args(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    hidden_dim=48,
    vocab_size=64,
    max_seq_len=128,
    tie_embeddings=False,
)
TIED = Qwen3Args(
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=4,
    head_dim=8,
    hidden_dim=40,
    vocab_size=48,
    max_seq_len=128,
    tie_embeddings=True,
    rope_theta=5e6,
    norm_eps=1e-5,
)
