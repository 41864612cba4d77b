"""TorchTitan's own code as the reference (pinned: torchtitan 0.3.0): its Qwen3 model forward on
the same weights, its warmup-stable-decay LR schedule, and its FLOPs-per-token formula.

On CPU the model is forward-only (flex attention has no CPU backward) and runs flex attention
eagerly: the unfused reference implementation of the same op, because compiling it for the CPU
takes tens of seconds per sequence length.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from titan_jax.config import LRScheduler
from titan_jax.models.qwen3.args import Qwen3Args

VERSION = "0.3.0"
INSTALL = (f"pip install --no-deps torchtitan=={VERSION} && pip install tyro einops "
           "spmd_types==0.2.3 torch_checkpointing triton  (`make install` does this)")


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
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

    config = Qwen3Model.Config(
        vocab_size=args.vocab_size, dim=args.dim, norm=_qwen3_norm(args.dim),
        enable_weight_tying=args.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=args.vocab_size, embedding_dim=args.dim),
        lm_head=Linear.Config(in_features=args.dim, out_features=args.vocab_size),
        layers=_build_qwen3_layers(
            n_layers=args.n_layers, dim=args.dim, n_heads=args.n_heads,
            n_kv_heads=args.n_kv_heads, head_dim=args.head_dim, hidden_dim=args.hidden_dim,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=args.head_dim, max_seq_len=max_seq_len,
                                   theta=args.rope_theta)),
    )
    # torchtitan hard-codes eps 1e-6 in its flavours; a checkpoint may say otherwise.
    norms = [config.norm] + [n for layer in config.layers for n in
                             (layer.attention_norm, layer.ffn_norm, layer.attention.qk_norm)]
    for norm in norms:
        norm.eps = args.norm_eps
    return config


def load_model(args: Qwen3Args, hf_dir: str | Path, max_seq_len: int) -> torch.nn.Module:
    """torchtitan's Qwen3 with the weights of a HF directory, via its `Qwen3StateDictAdapter`."""
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    config = model_config(args, max(max_seq_len, args.max_seq_len))
    model = config.build()
    model.init_states()  # computes the RoPE cache (a non-persistent buffer)
    hf_state = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        hf_state.update(load_file(file))
    state = Qwen3StateDictAdapter(config, None).from_hf(hf_state)
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def logits(model: torch.nn.Module, tokens_T: np.ndarray) -> np.ndarray:
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
        warmup_steps=sched.warmup_steps, decay_ratio=sched.decay_ratio,
        decay_type=sched.decay_type, min_lr_factor=sched.min_lr_factor)
    return lambda optimizer, total_steps: config.build(optimizers=[optimizer],
                                                       training_steps=total_steps)


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
