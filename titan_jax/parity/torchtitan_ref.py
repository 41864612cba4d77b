"""TorchTitan's own code as the reference (pinned: torchtitan 0.3.0): its Qwen3 and Qwen3-MoE
model forward on the same weights, its warmup-stable-decay LR schedule, and its FLOPs-per-token
formula.

On CPU the model is forward-only (flex attention has no CPU backward) and runs flex attention
eagerly: the unfused reference implementation of the same op, because compiling it for the CPU
takes tens of seconds per sequence length.

Qwen3-MoE runs torchtitan's own router, token dispatcher and grouped experts with three
adjustments, each because stock torchtitan cannot express the compared model otherwise:
- its `GroupedExperts` casts inputs and weights to bf16 whatever the model dtype; here the same
  three `torch._grouped_mm` calls run in the model's dtype (fp32);
- its MoE holds a per-layer `expert_bias_E` buffer that the HF state-dict adapter does not
  produce, so the strict load is given those keys (zeros: HF has no bias, or the bias given);
- its Qwen3 flavours hard-code `route_norm=True`; here it follows `norm_topk_prob`.
Its adapter reads only the hub's per-expert layout, so files in transformers 5's fused layout
(`mlp.experts.gate_up_proj`, `down_proj`) are split per expert first.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from titan_jax.config import LRScheduler
from titan_jax.models.qwen3.args import Qwen3Args
from titan_jax.models.spec import ModelArgs

if TYPE_CHECKING:  # torchtitan is imported where it is used: an optional reference
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.qwen3.model import Qwen3Model

VERSION = "0.3.0"
INSTALL = (
    f"pip install --no-deps torchtitan=={VERSION} && pip install tyro einops "
    "spmd_types==0.2.3 torch_checkpointing triton  (`make install` does this)"
)


def as_qwen3(args: ModelArgs) -> Qwen3Args | None:
    """`args` as the Qwen3 args this reference is built from; None for another family's."""
    return args if isinstance(args, Qwen3Args) else None


@functools.cache
def unavailable_reason() -> str | None:
    """None when torchtitan's Qwen3 can be used here, else why not and how to install it."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return f"torchtitan is not installed; install: {INSTALL}"
    if version != VERSION:
        return f"torchtitan {version} is installed; parity is pinned to {VERSION}: {INSTALL}"
    try:
        import torchtitan.models.qwen3  # noqa: F401
    except Exception as e:  # a missing small dependency surfaces as any import-time error
        return f"cannot import torchtitan.models.qwen3 ({type(e).__name__}: {e}); {INSTALL}"
    return None


def model_config(args: Qwen3Args, max_seq_len: int) -> Any:
    """torchtitan's `Qwen3Model.Config` for `args`, built like its own flavours."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    shape = dict(
        n_layers=args.n_layers,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=args.head_dim, max_seq_len=max_seq_len, theta=args.rope_theta),
    )
    if args.is_moe:
        layers = _build_qwen3_moe_layers(
            **shape,
            moe_hidden_dim=args.moe_inter_dim,
            num_experts=args.num_experts,
            top_k=args.top_k,
            moe_comm_backend="standard",
        )
        for layer in layers:  # torchtitan's flavours fix route_norm=True
            assert layer.moe is not None  # an MoE flavour's layer
            layer.moe.router.route_norm = args.norm_topk_prob
    else:
        layers = _build_qwen3_layers(**shape, hidden_dim=args.hidden_dim)
    config = Qwen3Model.Config(
        vocab_size=args.vocab_size,
        dim=args.dim,
        norm=_qwen3_norm(args.dim),
        enable_weight_tying=args.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=args.vocab_size, embedding_dim=args.dim),
        lm_head=Linear.Config(in_features=args.dim, out_features=args.vocab_size),
        layers=layers,
    )
    # torchtitan hard-codes eps 1e-6 in its flavours; a checkpoint may say otherwise.
    norms = [config.norm] + [
        n
        for layer in config.layers
        for n in (layer.attention_norm, layer.ffn_norm, layer.attention.qk_norm)
    ]
    for norm in norms:
        norm.eps = args.norm_eps
    return config


def load_model(
    args: Qwen3Args, hf_dir: str | Path, max_seq_len: int, expert_bias_LE: np.ndarray | None = None
) -> Qwen3Model:
    """torchtitan's Qwen3 with the weights of a HF directory, via its `Qwen3StateDictAdapter`
    (MoE: with the adjustments of the module docstring; `expert_bias_LE` is each layer's
    expert bias, zeros by default)."""
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    config = model_config(args, max(max_seq_len, args.max_seq_len))
    model = config.build()
    model.init_states()  # computes the RoPE cache (a non-persistent buffer)
    hf_state = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        hf_state.update(load_file(file))
    if args.is_moe:
        hf_state = per_expert_layout(hf_state)
    state = Qwen3StateDictAdapter(config, None).from_hf(hf_state)
    if args.is_moe:
        bias = (
            np.zeros((args.n_layers, args.num_experts), np.float32)
            if expert_bias_LE is None
            else np.asarray(expert_bias_LE, np.float32)
        )
        for i in range(args.n_layers):
            state[f"layers.{i}.moe.expert_bias_E"] = torch.from_numpy(bias[i].copy())
    model.load_state_dict(state, strict=True)
    model = model.float().eval()
    for layer in model.layers.values() if args.is_moe else ():
        experts = layer.moe.routed_experts.inner_experts
        experts.forward = functools.partial(grouped_experts_in_model_dtype, experts)
    return model


def grouped_experts_in_model_dtype(
    experts: GroupedExperts, x_RD: torch.Tensor, tokens_per_expert_E: torch.Tensor
) -> torch.Tensor:
    """torchtitan's `GroupedExperts.forward` (SwiGLU by three `torch._grouped_mm`) without its
    cast to bf16: the matmuls run in the weights' dtype."""
    offsets = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)

    def grouped_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)

    h_RF = F.silu(grouped_mm(x_RD, experts.w1_EFD)) * grouped_mm(x_RD, experts.w3_EFD)
    return grouped_mm(h_RF, experts.w2_EDF).type_as(x_RD)


def per_expert_layout(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors with transformers 5's fused experts (`mlp.experts.gate_up_proj` (E, 2F, D),
    gate rows first; `mlp.experts.down_proj` (E, D, F)) split into the hub's per-expert
    `mlp.experts.{j}.{gate,up,down}_proj.weight`, the only layout torchtitan's adapter reads."""
    out = {}
    for key, value in hf_state.items():
        prefix, _, name = key.rpartition(".")
        if not prefix.endswith(".mlp.experts") or name not in ("gate_up_proj", "down_proj"):
            out[key] = value
            continue
        for j, expert in enumerate(value):
            if name == "down_proj":
                out[f"{prefix}.{j}.down_proj.weight"] = expert
            else:
                gate, up = expert.chunk(2, dim=0)
                out[f"{prefix}.{j}.gate_proj.weight"] = gate
                out[f"{prefix}.{j}.up_proj.weight"] = up
    return out


def logits(model: Qwen3Model, tokens_T: np.ndarray) -> np.ndarray:
    """fp32 logits (T, V) of one sequence, called as torchtitan does: (tokens, positions, masks)."""
    tokens = torch.from_numpy(np.asarray(tokens_T, np.int64))[None]
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = model(tokens, positions, model.get_attention_masks(positions))
    return out[0].float().numpy()


def lr_scheduler(sched: LRScheduler) -> Callable[[torch.optim.Optimizer, int], Any]:
    """(optimizer, total_steps) -> torchtitan's LRSchedulersContainer (a LambdaLR per optimizer)."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    config = LRSchedulersContainer.Config(
        warmup_steps=sched.warmup_steps,
        decay_ratio=sched.decay_ratio,
        decay_type=sched.decay_type,
        min_lr_factor=sched.min_lr_factor,
    )
    return lambda optimizer, total_steps: config.build(
        optimizers=[optimizer], training_steps=total_steps
    )


def lr_factors(sched: LRScheduler, total_steps: int) -> list[float]:
    """torchtitan's LR multiplier at steps 0 .. total_steps - 1 (its lambda, called directly)."""
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    lambda_lr = lr_scheduler(sched)(dummy, total_steps).schedulers[0]
    return [lambda_lr.lr_lambdas[0](step) for step in range(total_steps)]


def flops_per_token(flavor: str, seq_len: int) -> float:
    """torchtitan's training FLOPs per token of its own `flavor`, counted on a meta-device model."""
    from torchtitan.models.qwen3 import qwen3_configs

    config = qwen3_configs[flavor]("flex")
    with torch.device("meta"):
        model = config.build()
    return float(config.get_nparams_and_flops(model, seq_len)[1])
