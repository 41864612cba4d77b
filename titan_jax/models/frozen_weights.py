"""A LoRA model's frozen base in its module graph: each frozen weight becomes a `FrozenParam`
in the base's float dtype, or a `QuantizedWeight` (codes and scales, `models/frozen_base.py`),
after the model is built and before its params leave it (`store_frozen`), so random init, HF
loads and the abstract model all store the base the same way.

Which weights a quantized base quantizes is declared where they are: a projection's `nnx.Param`
carries `in_dims` metadata (its input dims, one layer's or expert's); the others (embeddings,
norms, router) carry none and stay floats.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from titan_jax.config_schema import ConfigError
from titan_jax.models.frozen_base import FrozenBase, dequantize, quantize, scale_axes
from titan_jax.models.sharding_hooks import FrozenParam, gather_frozen

# The Param metadata key naming a projection's input dims (what a quantized base reduces).
IN_DIMS = "in_dims"


class QuantizedWeight(nnx.Module):
    """A frozen weight as `qvalue` codes and `scale`s, stacked like the weight was; read by
    `use_param` (`dequantized`): both gathered as stored, then dequantized by qwix."""

    def __init__(
        self,
        codes: jax.Array,
        scale: jax.Array,
        axes: tuple[str | None, ...],
        shape: tuple[int, ...],
        base: FrozenBase,
    ):
        lead = codes.ndim - len(axes)  # stacked dims (layers) the axes leave out
        self.qvalue = FrozenParam(codes, logical_axes=axes)
        self.scale = FrozenParam(scale, logical_axes=scale_axes(axes, shape, scale.shape[lead:]))
        self.base = base

    def dequantized(self, dtype: jnp.dtype) -> jax.Array:
        return dequantize(gather_frozen(self.qvalue), gather_frozen(self.scale), self.base).astype(
            dtype
        )


def store_frozen(model: nnx.Module, base: FrozenBase) -> None:
    """Every param of `model` but the LoRA adapters stored as `base` says, in place (nothing
    changes for an fp32 base: full fine-tuning's layout)."""
    if not base.narrowed:
        return
    for path, node in list(nnx.iter_graph(model)):
        if not isinstance(node, nnx.Param) or isinstance(node, nnx.LoRAParam):
            continue
        parent: Any = model
        for key in path[:-1]:  # attribute names, and item indices inside an nnx.List
            parent = getattr(parent, key) if isinstance(key, str) else parent[key]
        metadata = node.get_metadata()
        value, axes = node[...], tuple(node.logical_axes)
        in_dims = metadata.get(IN_DIMS)
        if base.quantized and in_dims is not None:
            lead = value.ndim - len(axes)
            codes, scale = quantize(value, tuple(d + lead for d in in_dims), base)
            stored = QuantizedWeight(codes, scale, axes, value.shape[lead:], base)
        else:
            stored = FrozenParam(value.astype(base.float_dtype), **metadata)
        if isinstance(path[-1], str):
            setattr(parent, path[-1], stored)
        else:
            parent[path[-1]] = stored


def check_blocks(model: nnx.Module, base: FrozenBase) -> None:
    """nf4's blocks must tile each quantized weight's last input dim whole; refused in one
    line with the largest block size that tiles them all. Run on the (abstract) model before
    `store_frozen`, outside any trace."""
    if base.dtype != "nf4":
        return
    dims = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and IN_DIMS in node.get_metadata():
            lead = len(node.shape) - len(node.logical_axes)
            dims[".".join(map(str, path))] = node.shape[lead + node.get_metadata()[IN_DIMS][-1]]
    bad = next(((name, n) for name, n in dims.items() if n % base.block_size), None)
    if bad is not None:
        fits = max(b for b in range(1, base.block_size) if all(n % b == 0 for n in dims.values()))
        raise ConfigError(
            f"lora.base_block_size={base.block_size} does not divide the input "
            f"dim ({bad[1]}) of {bad[0]}; use lora.base_block_size={fits}"
        )
