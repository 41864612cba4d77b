"""Qwen3 model hyper-parameters and the registry of named flavours (sizes as in TorchTitan/HF)."""

from __future__ import annotations

import dataclasses
import math

from titan_jax.config_schema import Moe
from titan_jax.models.spec import pick_flavor
from titan_jax.yarn import MAX_SIZE, YarnScaling

__all__ = ["MAX_SIZE", "QWEN3_FLAVORS", "Qwen3Args", "YarnScaling", "get_flavor"]


@dataclasses.dataclass(frozen=True)
class Qwen3Args:
    """Shape of a Qwen3 model. Field names follow TorchTitan's `Qwen3ModelArgs`."""

    dim: int = 256
    n_layers: int = 8
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128
    hidden_dim: int = 3072  # dense SwiGLU inner size
    vocab_size: int = 2048
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_seq_len: int = 4096
    yarn: YarnScaling | None = None  # RoPE scaling; None: plain RoPE
    tie_embeddings: bool = True
    # Mixture of experts (0 experts = dense); every layer is MoE when enabled, no shared experts.
    num_experts: int = 0
    top_k: int = 0
    moe_inter_dim: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k gate weights (HF; TorchTitan route_norm)
    # The `[moe]` balancing knobs (config_schema.Moe owns their defaults and meaning).
    load_balance_coeff: float = Moe.load_balance_coeff
    router_aux_loss_coef: float = Moe.router_aux_loss_coef

    def __post_init__(self) -> None:
        if isinstance(self.yarn, dict):  # read back from JSON (checkpoint metadata)
            object.__setattr__(self, "yarn", YarnScaling(**self.yarn))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def validate(self) -> None:
        """Sizes in [1, MAX_SIZE] (0 for the MoE fields of a dense model), finite positive
        floats, and the shapes' own rules; messages name the fields as Qwen3Args spells them."""
        sizes = [
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "vocab_size",
            "max_seq_len",
            *(["num_experts", "top_k", "moe_inter_dim"] if self.is_moe else ["hidden_dim"]),
        ]
        for name in sizes:
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= MAX_SIZE:
                raise ValueError(f"{name}={value!r} must be an integer in [1, {MAX_SIZE}]")
        for name in ("norm_eps", "rope_theta", "load_balance_coeff", "router_aux_loss_coef"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be > 0")
        if not self.rope_theta > 1:  # frequencies are theta ** (-i / d): 1 turns none
            raise ValueError(f"rope_theta={self.rope_theta} must be > 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.yarn is not None:
            self.yarn.validate()
        if self.is_moe and not self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")


_QWEN3_VOCAB = 151936

QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(),
    "0.6B": Qwen3Args(
        dim=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        hidden_dim=3072,
        vocab_size=_QWEN3_VOCAB,
        max_seq_len=40960,
    ),
    "1.7B": Qwen3Args(
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        hidden_dim=6144,
        vocab_size=_QWEN3_VOCAB,
        max_seq_len=40960,
    ),
    "4B": Qwen3Args(
        dim=2560,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        hidden_dim=9728,
        vocab_size=_QWEN3_VOCAB,
        max_seq_len=40960,
    ),
    "8B": Qwen3Args(
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        hidden_dim=12288,
        vocab_size=_QWEN3_VOCAB,
        max_seq_len=40960,
        tie_embeddings=False,
    ),
    "14B": Qwen3Args(
        dim=5120,
        n_layers=40,
        n_heads=40,
        n_kv_heads=8,
        hidden_dim=17408,
        vocab_size=_QWEN3_VOCAB,
        max_seq_len=40960,
        tie_embeddings=False,
    ),
    "32B": Qwen3Args(
        dim=5120,
        n_layers=64,
        n_heads=64,
        n_kv_heads=8,
        hidden_dim=25600,
        vocab_size=_QWEN3_VOCAB,
        max_seq_len=40960,
        tie_embeddings=False,
    ),
    # Mixture of experts (TorchTitan's Qwen3 MoE flavours; HF Qwen3-30B-A3B / 235B-A22B).
    "debugmodel_moe": Qwen3Args(tie_embeddings=False, num_experts=64, top_k=8, moe_inter_dim=768),
    "30B-A3B": Qwen3Args(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=_QWEN3_VOCAB,
        max_seq_len=40960,
        tie_embeddings=False,
        num_experts=128,
        top_k=8,
        moe_inter_dim=768,
    ),
    "235B-A22B": Qwen3Args(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        vocab_size=_QWEN3_VOCAB,
        max_seq_len=40960,
        tie_embeddings=False,
        num_experts=128,
        top_k=8,
        moe_inter_dim=1536,
    ),
}


def get_flavor(name: str) -> Qwen3Args:
    """The registered flavour `name`, or a ConfigError listing the valid ones."""
    return pick_flavor("Qwen3", QWEN3_FLAVORS, name)
