"""LoRA adapters (`[lora]`), as PEFT's `LoraLayer` computes them: `y = x W + (x A) B * alpha / r`,
A (the weight's in dims..., r) initialised like torch.nn.Linear's weight (kaiming-uniform with
a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))), B (r, the weight's out dims...) zeros, so a
fresh adapter changes nothing.

The adapters are ordinary parameters of the model, not qwix's `LoraProvider`
(`apply_lora_to_model`): the provider intercepts `dot_general` by module path and finds the
weight by identity among the current module's attributes, creating A and B lazily on the
first call. Here the layers run under `lax.scan` over merged module state and every weight
is read through `use_param` (cast and gathered), so the provider would find no weight, and
adapters created inside the scan would be one layer's, not stacked. Declared as `nnx.Param`s
(`nnx.LoRAParam`, so the build can tell them from the base) with logical axes, they are
stacked per layer, sharded by the rules table and read through `use_param` like every other
weight (the module, `Adapter`, is qwen3/adapter.py's).
The delta itself is qwix's LoRA math (`_compute_lora_delta`, what its provider adds to a
`dot_general`), imported where an adapter runs, as `quantization.py` imports qwix.

Adapters train, the base stays frozen: `build.py` names the adapters' params
(`ModelDef.trainable`) and the train step differentiates and optimizes only those.

An adapter sits in the params tree beside its weight: `{name}_lora` = {"lora_a", "lora_b"} next
to `{name}`, both stacked on the same leading dims (the layers, and the experts for an expert
weight: one A and B per expert, A (..., E, in..., r), B (..., E, r, out...)). An adapter over
several weights that read the same input is *joined*: one A, and B's first out dim indexes the
weights, keyed by their names joined with `JOIN` (`w1_and_w3_lora` beside the MoE's `w1` and
`w3`: transformers fuses the experts' gate and up projections into one `gate_up_proj`, and
PEFT's adapter on it is one A and one B over both outputs). `merged` folds adapters into the
weights for a plain model (`titan-jax convert --to hf`, `checkpoint.last_save_in_hf`);
`merge_into` is the same fold for one weight (the MoE experts' on CPU, whose kernel takes plain
weights; the grouped kernels elsewhere run the adapter's products on each expert's rows:
`models/qwen3/adapter.py`).

The frozen base may be stored below fp32 (`Lora.base`: bf16, or QLoRA's int8/fp8/nf4:
`models/frozen_base.py`); `merged` reads it back in fp32 (dequantized) first.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.models.frozen_base import FP32_BASE, FrozenBase, dequantized

Array = jax.Array
Params = dict[str, Any]

# An adapter's key beside its weight's: `wq` -> `wq_lora` (qwen3/model.py's attributes).
ADAPTER_SUFFIX = "_lora"
# Joins the names of the weights a joined adapter spans: `w1_and_w3_lora`.
JOIN = "_and_"

# The logical axis of the adapters' rank dim (parallel/rules.py: replicated).
RANK_AXIS = "lora_rank"
# torch.nn.Linear's (and so PEFT's lora_A) init: kaiming_uniform(a=sqrt(5)), a uniform bound
# of gain * sqrt(3 / fan_in) with gain^2 = 2 / (1 + 5): variance scale 1/3.
_KAIMING_UNIFORM_SQRT5 = 1 / 3


@dataclasses.dataclass(frozen=True)
class Lora:
    """Which projections carry adapters (HF/PEFT names, e.g. "q_proj"), their rank and alpha,
    the dropout on their input in training, and how the frozen base is stored; rank 0: none."""

    rank: int = 0
    alpha: float = 8.0
    projections: tuple[str, ...] = ()
    dropout: float = 0.0
    base: FrozenBase = FP32_BASE

    def targets(self, projection: str) -> bool:
        return self.rank > 0 and projection in self.projections


NO_LORA = Lora()
# Folded into the run's seed for the dropout keys: a stream apart from init's.
_DROPOUT_STREAM = 0x10BA


def dropout_key(seed: int, step: Array) -> Array:
    """The LoRA dropout key of training step `step` (a function of the seed and the step, so a
    resumed run draws what the uninterrupted one did). The step folds in each microbatch's
    index, the model each layer's and each adapter's (`dropout`)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM), step)


def dropout(rows: Array, key: Array, rate: float) -> Array:
    """PEFT's `lora_dropout` (torch's `nn.Dropout`): each element zeroed with probability
    `rate`, the others scaled by 1 / (1 - rate)."""
    keep = jax.random.bernoulli(key, 1 - rate, rows.shape)
    return jnp.where(keep, rows / jnp.asarray(1 - rate, rows.dtype), jnp.zeros((), rows.dtype))


def init_a(
    key: jax.Array, in_shape: tuple[int, ...], rank: int, stack_shape: tuple[int, ...] = ()
) -> Array:
    """A fresh A (stack..., in..., rank) in fp32: PEFT's, torch.nn.Linear's init over
    fan_in = prod(in), for each of the stacked adapters (experts)."""
    lead, n_in = len(stack_shape), len(in_shape)
    init = jax.nn.initializers.variance_scaling(
        _KAIMING_UNIFORM_SQRT5,
        "fan_in",
        "uniform",
        in_axis=tuple(range(lead, lead + n_in)),
        out_axis=lead + n_in,
        batch_axis=tuple(range(lead)),
    )
    return init(key, (*stack_shape, *in_shape, rank), jnp.float32)


def lora_delta(rows: Array, a: Array, b: Array, scale: float) -> Array:
    """The adapter's term `(rows A) B * scale` for `rows` (R, in...), A (in..., r) and
    B (r, out...), as the weights are used (cast, gathered): (R, out...) in the rows' dtype."""
    from qwix._src.providers.lora import _compute_lora_delta

    n_in = a.ndim - 1
    ins, rank, outs = a.shape[:n_in], b.shape[0], b.shape[1:]
    # B's out dims merged, as `project` merges a weight's: one 2-D matmul per factor.
    delta = _compute_lora_delta(
        rows,
        a,
        b.reshape(rank, math.prod(outs)),
        tuple(range(1, n_in + 1)),
        (),
        ins,
        (),
        (math.prod(outs),),
        rank,
    )
    return (delta * jnp.asarray(scale, delta.dtype)).reshape(-1, *outs)


def merged(params: Params, lora: Lora) -> Params:
    """`params` with every adapter folded into the weight(s) beside it, `W + (A B) * alpha / r`
    in fp32 (PEFT's `merge_and_unload`), and the adapters dropped: a plain model's params,
    which compute what the adapted model computes (a quantized base dequantized: fp32)."""
    return _merged(dequantized(params, lora.base), lora)


def _merged(params: Params, lora: Lora) -> Params:
    if not isinstance(params, dict):
        return params
    # Subtrees, or the weights themselves (what `fold` takes) at the leaves.
    out: dict[str, Any] = {
        k: _merged(v, lora) for k, v in params.items() if not k.endswith(ADAPTER_SUFFIX)
    }
    for key, adapter in params.items():
        if key.endswith(ADAPTER_SUFFIX):
            names = key[: -len(ADAPTER_SUFFIX)].split(JOIN)
            folded = fold(
                [out[n] for n in names],
                adapter["lora_a"],
                adapter["lora_b"],
                lora.alpha / lora.rank,
            )
            out.update(zip(names, folded, strict=True))
    return out


def fold(weights: list[Array], a: Array, b: Array, scale: float) -> list[Array]:
    """Each weight (lead..., in..., out...) plus its share of the adapter A (lead..., in..., r),
    B (lead..., r, [len(weights),] out...): B's dim after the rank indexes the weights of a
    joined adapter."""
    if len(weights) == 1:
        return [merge_into(weights[0], a, b, scale)]
    lead = a.ndim + b.ndim - 3 - weights[0].ndim  # B's rank dim
    return [merge_into(w, a, jnp.take(b, i, axis=lead + 1), scale) for i, w in enumerate(weights)]


def merge_into(w: Array, a: Array, b: Array, scale: float) -> Array:
    """W (lead..., in..., out...) + A (lead..., in..., r) B (lead..., r, out...) * scale, summed
    in fp32, in W's dtype."""
    lead = a.ndim + b.ndim - w.ndim - 2  # the stacked dims all three share
    n_in = a.ndim - lead - 1
    stack, ins, outs = w.shape[:lead], w.shape[lead : lead + n_in], w.shape[lead + n_in :]
    a2 = a.astype(jnp.float32).reshape(*stack, math.prod(ins), a.shape[-1])
    b2 = b.astype(jnp.float32).reshape(*stack, b.shape[lead], math.prod(outs))
    delta = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(w.shape)
    return (w.astype(jnp.float32) + delta * jnp.float32(scale)).astype(w.dtype)


def adapters_off(params: Params) -> Params:
    """`params` with every adapter's B zero: the base model's output, bitwise (`(x A) 0` adds
    an exact 0), from the same weights (no second copy of the model; B is r x out). The
    reference model of DPO with LoRA (train/dpo.py), as PEFT's disabled adapters are TRL's."""
    if not isinstance(params, dict):
        return params
    return {
        k: (
            {**v, "lora_b": jnp.zeros_like(v["lora_b"])}
            if k.endswith(ADAPTER_SUFFIX)
            else adapters_off(v)
        )
        for k, v in params.items()
    }
