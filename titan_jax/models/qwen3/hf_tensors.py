"""The tensor map between HF Qwen3 / Qwen3-MoE checkpoints and titan-jax params.

Name and layout mapping: HF `Qwen3ForCausalLM` stores torch Linear weights (out, in); titan-jax
stores (in, out) with layers stacked on a leading axis. Below, prefix `m.l.{i}.` is
`model.layers.{i}.` and the titan-jax name `L.` is `layers.` indexed at layer i.

    model.embed_tokens.weight              (V, D)      tok_embeddings          (V, D)
    m.l.{i}.self_attn.q_proj.weight        (H*hd, D)   L.attention.wq          (D, H, hd)
    m.l.{i}.self_attn.k_proj.weight        (KV*hd, D)  L.attention.wk          (D, KV, hd)
    m.l.{i}.self_attn.v_proj.weight        (KV*hd, D)  L.attention.wv          (D, KV, hd)
    m.l.{i}.self_attn.o_proj.weight        (D, H*hd)   L.attention.wo          (H, hd, D)
    m.l.{i}.self_attn.{q,k}_norm.weight    (hd,)       L.attention.{q,k}_norm.weight
    m.l.{i}.mlp.gate_proj.weight           (F, D)      L.feed_forward.w1       (D, F)
    m.l.{i}.mlp.up_proj.weight             (F, D)      L.feed_forward.w3       (D, F)
    m.l.{i}.mlp.down_proj.weight           (D, F)      L.feed_forward.w2       (F, D)
    m.l.{i}.input_layernorm.weight         (D,)        L.attention_norm.weight
    m.l.{i}.post_attention_layernorm.weight (D,)       L.ffn_norm.weight
    model.norm.weight                      (D,)        norm.weight
    lm_head.weight                         (V, D)      lm_head (D, V), untied models only

MoE layers (`model.layers.{i}.mlp.*`, in place of the dense MLP rows above; `L.moe.*` is
stacked over layers, then experts):

    m.l.{i}.mlp.gate.weight                (E, D)      L.moe.gate              (D, E)
    m.l.{i}.mlp.experts.{j}.gate_proj.weight (F, D)    L.moe.w1[j]             (D, F)
    m.l.{i}.mlp.experts.{j}.up_proj.weight (F, D)      L.moe.w3[j]             (D, F)
    m.l.{i}.mlp.experts.{j}.down_proj.weight (D, F)    L.moe.w2[j]             (F, D)

LoRA adapters (`peft_tensors`, PEFT's adapter file; `p` = `base_model.model.model.layers.{i}`,
r the rank, E the experts; dense projections' A (r, in) and B (out, r) as any weight):

    p.self_attn.q_proj.lora_A.weight      (r, D)      L.attention.wq_lora.lora_a  (D, r)
    p.mlp.experts[.base_layer].lora_A.weight (E*r, D) L.moe.w1_and_w3_lora.lora_a (E, D, r)
    p.mlp.experts[.base_layer].lora_B.weight (2F, r*E) L.moe.w1_and_w3_lora.lora_b (E, r, 2, F)
    p.mlp.experts.lora_A.weight           (E*r, F)    L.moe.w2_lora.lora_a        (E, F, r)
    p.mlp.experts.lora_B.weight           (D, r*E)    L.moe.w2_lora.lora_b        (E, r, D)

The experts' are PEFT's `ParamWrapper`s on transformers' fused `gate_up_proj` and `down_proj`:
A's rows expert-major, B's columns rank-major (`ParamWrapper.get_delta_weight`); with both
targeted, the gate_up wrapper is the inner one (`.base_layer`).

The MoE expert bias is a training buffer with no HF counterpart: it is not exported, and a
model loaded from HF starts with a zero bias (what HF's router computes).
"""

from __future__ import annotations

import re

import numpy as np

from titan_jax.models.lora import ADAPTER_SUFFIX, Lora
from titan_jax.models.qwen3.args import Qwen3Args
from titan_jax.models.qwen3.moe import DOWN, GATE_UP
from titan_jax.models.safetensors_io import HFTensor

# (titan path under `layers`, HF name under model.layers.{i}, n_in)
_LAYER_TENSORS = (
    (("attention", "wq"), "self_attn.q_proj.weight", 1),
    (("attention", "wk"), "self_attn.k_proj.weight", 1),
    (("attention", "wv"), "self_attn.v_proj.weight", 1),
    (("attention", "wo"), "self_attn.o_proj.weight", 2),
    (("attention", "q_norm", "weight"), "self_attn.q_norm.weight", None),
    (("attention", "k_norm", "weight"), "self_attn.k_norm.weight", None),
    (("feed_forward", "w1"), "mlp.gate_proj.weight", 1),
    (("feed_forward", "w3"), "mlp.up_proj.weight", 1),
    (("feed_forward", "w2"), "mlp.down_proj.weight", 1),
    (("attention_norm", "weight"), "input_layernorm.weight", None),
    (("ffn_norm", "weight"), "post_attention_layernorm.weight", None),
)
# HF tensors that carry no weights of ours (old checkpoints store the RoPE frequencies).
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _expert_tensors(args: Qwen3Args, i: int) -> list[HFTensor]:
    """Layer i's router and per-expert tensors (the hub's layout; transformers 5 fuses them in
    memory but `save_pretrained` writes them per expert)."""
    d, e, f = args.dim, args.num_experts, args.moe_inter_dim
    prefix = f"model.layers.{i}.mlp"
    out = [HFTensor(f"{prefix}.gate.weight", ("layers", "moe", "gate"), i, (d, e), 1)]
    for j in range(e):
        out += [
            HFTensor(f"{prefix}.experts.{j}.{name}.weight", ("layers", "moe", ours), i, shape, 1, j)
            for name, ours, shape in (
                ("gate_proj", "w1", (d, f)),
                ("up_proj", "w3", (d, f)),
                ("down_proj", "w2", (f, d)),
            )
        ]
    return out


def _layer_shapes(args: Qwen3Args) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Each layer tensor's titan-jax shape (per layer), by its path under `layers`."""
    d, f, hd = args.dim, args.hidden_dim, args.head_dim
    return {
        ("attention", "wq"): (d, args.n_heads, hd),
        ("attention", "wk"): (d, args.n_kv_heads, hd),
        ("attention", "wv"): (d, args.n_kv_heads, hd),
        ("attention", "wo"): (args.n_heads, hd, d),
        ("attention", "q_norm", "weight"): (hd,),
        ("attention", "k_norm", "weight"): (hd,),
        ("feed_forward", "w1"): (d, f),
        ("feed_forward", "w3"): (d, f),
        ("feed_forward", "w2"): (f, d),
        ("attention_norm", "weight"): (d,),
        ("ffn_norm", "weight"): (d,),
    }


def hf_tensors(args: Qwen3Args) -> list[HFTensor]:
    """Every HF tensor of the model, in HF's file order."""
    d, v = args.dim, args.vocab_size
    shapes = _layer_shapes(args)
    out = [HFTensor("model.embed_tokens.weight", ("tok_embeddings",), None, (v, d), None)]
    for i in range(args.n_layers):
        out += [
            HFTensor(f"model.layers.{i}.{name}", ("layers", *path), i, shapes[path], n_in)
            for path, name, n_in in _LAYER_TENSORS
            if not (args.is_moe and path[0] == "feed_forward")
        ]
        if args.is_moe:
            out += _expert_tensors(args, i)
    out.append(HFTensor("model.norm.weight", ("norm", "weight"), None, (d,), None))
    if not args.tie_embeddings:
        out.append(HFTensor("lm_head.weight", ("lm_head",), None, (d, v), 1))
    return out


def peft_tensors(args: Qwen3Args, lora: Lora) -> list[HFTensor]:
    """The tensors of PEFT's adapter file for `lora`'s adapters (`adapter_model.safetensors`,
    as PEFT's `save_pretrained` names them: the model's module path under `base_model.model.`,
    the adapter's name dropped). torch's lora_A (r, in) and lora_B (out, r) are Linear weights,
    so a dense A (in..., r) and B (r, out...) map as any weight does, in dims first; the
    experts' as the module docstring shows."""
    shapes = _layer_shapes(args)
    out = []
    for i in range(args.n_layers):
        for path, name, n_in in _LAYER_TENSORS:
            module = name.removesuffix(".weight")
            if n_in is None or not lora.targets(module.rpartition(".")[2]):
                continue
            shape = shapes[path]
            adapter = ("layers", *path[:-1], path[-1] + ADAPTER_SUFFIX)
            prefix = f"base_model.model.model.layers.{i}.{module}"
            out += [
                HFTensor(
                    f"{prefix}.lora_A.weight",
                    (*adapter, "lora_a"),
                    i,
                    (*shape[:n_in], lora.rank),
                    n_in,
                ),
                HFTensor(
                    f"{prefix}.lora_B.weight",
                    (*adapter, "lora_b"),
                    i,
                    (lora.rank, *shape[n_in:]),
                    1,
                ),
            ]
        if args.is_moe:
            out += _expert_adapter_tensors(args, lora, i)
    return out


def _expert_adapter_tensors(args: Qwen3Args, lora: Lora, i: int) -> list[HFTensor]:
    d, e, f, r = args.dim, args.num_experts, args.moe_inter_dim, lora.rank
    prefix = f"base_model.model.model.layers.{i}.mlp.experts"
    inner = ".base_layer" if lora.targets(DOWN) else ""  # gate_up's wrapper is inside down's
    a_dims = ((0, 2), (1,))  # (E, in, r) -> (E*r, in)
    out = []
    for projection, key, wrapper, a_shape, b_shape, b_dims in (
        (GATE_UP, "w1_and_w3", inner, (e, d, r), (e, r, 2, f), ((2, 3), (1, 0))),
        (DOWN, "w2", "", (e, f, r), (e, r, d), ((2,), (1, 0))),
    ):
        if lora.targets(projection):
            path = ("layers", "moe", key + ADAPTER_SUFFIX)
            out += [
                HFTensor(
                    f"{prefix}{wrapper}.lora_A.weight",
                    (*path, "lora_a"),
                    i,
                    a_shape,
                    None,
                    hf_dims=a_dims,
                ),
                HFTensor(
                    f"{prefix}{wrapper}.lora_B.weight",
                    (*path, "lora_b"),
                    i,
                    b_shape,
                    None,
                    hf_dims=b_dims,
                ),
            ]
    return out


def fused_expert_layout(tensors: dict[str, np.ndarray], args: Qwen3Args) -> dict[str, np.ndarray]:
    """Hub-layout tensors (per expert) in transformers 5's in-memory layout, where each MoE
    layer holds `mlp.experts.gate_up_proj` (E, 2F, D), gate rows first, and
    `mlp.experts.down_proj` (E, D, F): what a live model's `named_parameters` names."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in range(args.n_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        per_expert = [
            {
                name: tensors[f"{prefix}.{j}.{name}.weight"]
                for name in ("gate_proj", "up_proj", "down_proj")
            }
            for j in range(args.num_experts)
        ]
        out[f"{prefix}.gate_up_proj"] = np.stack(
            [np.concatenate([e["gate_proj"], e["up_proj"]]) for e in per_expert]
        )
        out[f"{prefix}.down_proj"] = np.stack([e["down_proj"] for e in per_expert])
    return out
