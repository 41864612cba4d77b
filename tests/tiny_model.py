"""The tiny Qwen3 most tests train: every code path of the real model at a glance's cost."""

from titan_jax.models.qwen3 import Qwen3Args

# GQA 2, two stacked layers; the vocabulary fits the shipped tokenizer (2048 tokens).
TINY = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
                 vocab_size=2048, max_seq_len=64)
