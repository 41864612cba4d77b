"""PEFT LoRA models and titan-jax's twins of them, for the tests that compare against PEFT (the
`parity` extra: import this module only where peft and torch are installed)."""

import jax
import numpy as np
import peft
import torch
from hf_fixtures import random_hf_model
from tiny_model import UNTIED

from titan_jax.models.lora import Lora
from titan_jax.models.qwen3 import build_model_def, hf
from titan_jax.models.spec import BuildOptions
from titan_jax.trees import merge_nested, nested_get, split_by_name

# HF/PEFT projection -> (its module in a HF layer, titan-jax's weight path in a layer, the
# weight's number of in dims).
PROJECTIONS = {
    "q_proj": ("self_attn", ("attention", "wq"), 1),
    "k_proj": ("self_attn", ("attention", "wk"), 1),
    "v_proj": ("self_attn", ("attention", "wv"), 1),
    "o_proj": ("self_attn", ("attention", "wo"), 2),
    "gate_proj": ("mlp", ("feed_forward", "w1"), 1),
    "up_proj": ("mlp", ("feed_forward", "w3"), 1),
    "down_proj": ("mlp", ("feed_forward", "w2"), 1),
}


def peft_model(tmp_path, targets, rank, alpha):
    """A random HF Qwen3 (UNTIED: head_dim != dim / heads) saved to `tmp_path`, wrapped by
    PEFT's LoRA with random nonzero adapters."""
    base = random_hf_model(UNTIED)
    base.save_pretrained(str(tmp_path))
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def lora_modules(model, layer: int, projection: str):
    group = PROJECTIONS[projection][0]
    module = getattr(getattr(model.base_model.model.model.layers[layer], group), projection)
    return module.lora_A["default"], module.lora_B["default"]


def ours_from_peft(model, targets, rank, alpha, tmp_path):
    """(titan-jax's model def with the same adapters, its params: the saved base weights and
    PEFT's adapters in titan-jax's layout)."""
    ours = build_model_def(UNTIED, BuildOptions(lora=Lora(rank, alpha, tuple(targets))))
    adapters = split_by_name(
        jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), ours.abstract_params), ours.trainable
    )[0]
    for projection in targets:
        _, path, n_in = PROJECTIONS[projection]
        node = nested_get(adapters, ("layers", *path[:-1], f"{path[-1]}_lora"))
        for layer in range(UNTIED.n_layers):
            a, b = lora_modules(model, layer, projection)
            # torch's (r, in) and (out, r) -> titan-jax's (in..., r) and (r, out...).
            a_ours = node["lora_a"][layer]
            a_ours[...] = a.weight.detach().numpy().T.reshape(a_ours.shape)
            b_ours = node["lora_b"][layer]
            b_ours[...] = b.weight.detach().numpy().T.reshape(b_ours.shape)
    return ours, merge_nested(hf.load_hf_params(tmp_path, UNTIED), adapters)
