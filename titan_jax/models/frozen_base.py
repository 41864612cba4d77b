"""How a LoRA model's frozen base is stored (`lora.base_dtype`): in fp32 or bf16, or quantized
as QLoRA stores it, codes and scales from qwix 0.1.8's public `qwix.quantize` (dequantized at
use by `qwix.dequantize`).

The base never receives an update, so it needs no fp32 master copy. Quantized bases follow
PEFT's QLoRA (bitsandbytes): the projections (attention's q/k/v/o, the dense SwiGLU's and the
MoE experts' w1/w2/w3) are quantized; the embeddings, lm_head, norms and the MoE router stay
in bf16 (`UNQUANTIZED_DTYPE`).
- int8 and fp8 (e4m3): one scale per output channel (absmax over the input dims), bitsandbytes'
  vector-wise int8;
- nf4: QLoRA's NormalFloat4, one scale per block of `block_size` input elements (QLoRA's 64)
  of each output channel. The 4-bit codes are stored two to a byte along the weight's last dim
  (`pack_nf4`): XLA packs uint4 in memory, but orbax's TensorStore cannot save it.
A quantized weight is `{"qvalue": codes, "scale": fp32 scales}` in the params tree; both carry
the weight's logical axes (None on the scale's reduced dims), so the rules table shards them
like the weight and SimpleFSDP gathers the codes in their own dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
Params = dict[str, Any]

# `lora.base_dtype`'s quantized formats and their qwix qtypes.
QTYPES: dict[str, Any] = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "nf4": "nf4"}
FLOAT_DTYPES = ("float32", "bfloat16")
# The frozen weights a quantized base leaves unquantized (PEFT's QLoRA: the model's bf16).
UNQUANTIZED_DTYPE = jnp.bfloat16
# NF4's code book (QLoRA, arXiv 2305.14314 Appendix E) as qwix's `get_nf4_buckets` holds it
# (tests check they are equal): written out, as qwix's is a device array, which a trace for
# compile-only TPU devices cannot read back.
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# Keys of a quantized weight in the params tree.
CODES, SCALE = "qvalue", "scale"


@dataclasses.dataclass(frozen=True)
class FrozenBase:
    """The frozen base's storage: `dtype` one of FLOAT_DTYPES or QTYPES' names; `block_size`:
    nf4's input elements per scale."""

    dtype: str = "float32"
    block_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.dtype in QTYPES

    @property
    def float_dtype(self) -> jnp.dtype:
        """The dtype of the frozen weights stored as floats (all of them, or those a
        quantized base leaves)."""
        return jnp.dtype(UNQUANTIZED_DTYPE if self.quantized else self.dtype)

    @property
    def narrowed(self) -> bool:
        """Whether the base is stored in anything but fp32 (fp32: as full fine-tuning)."""
        return self.dtype != "float32"


FP32_BASE = FrozenBase()


def quantize(w: Array, in_dims: tuple[int, ...], base: FrozenBase) -> tuple[Array, Array]:
    """(codes, scale) of `w` quantized as `base` says; `in_dims`: the weight's input
    (contracted) dims; every other dim (outputs, and stacked layers or experts) keeps its own
    scales."""
    import qwix

    if base.dtype == "nf4":
        tiled = {in_dims[-1]: base.block_size}
        channelwise = tuple(d for d in range(w.ndim) if d not in tiled)
    else:
        tiled, channelwise = {}, tuple(d for d in range(w.ndim) if d not in in_dims)
    q = qwix.quantize(
        w.astype(jnp.float32), QTYPES[base.dtype], channelwise_axes=channelwise, tiled_axes=tiled
    )
    return (pack_nf4(q.qvalue) if base.dtype == "nf4" else q.qvalue), q.scale


def dequantize(codes: Array, scale: Array, base: FrozenBase) -> Array:
    """The weight (fp32) that `quantize` stored as `codes` and `scale`: qwix's `dequantize`
    (int8, fp8), or the same numbers for nf4 by elementwise ops only. qwix looks nf4 codes up
    by a gather over the flattened weight, which XLA:TPU materialises with int32 indices: 8B
    QLoRA on v5e-4 then needs about three times the temporaries
    (docs/notes/2026-12-06-lora-memory.md)."""
    import qwix

    if base.dtype != "nf4":
        return qwix.dequantize(qwix.QArray(codes, scale, None, QTYPES[base.dtype]))
    codes = unpack_nf4(codes)
    values = jnp.zeros(codes.shape, jnp.float32)
    for code, value in enumerate(NF4_VALUES):
        values = jnp.where(codes == code, jnp.float32(value), values)
    for dim, (n, blocks) in enumerate(zip(values.shape, scale.shape, strict=True)):
        if blocks not in (1, n):  # a scale per block of n // blocks
            scale = jnp.repeat(scale, n // blocks, axis=dim)
    return values * scale


def pack_nf4(codes: Array) -> Array:
    """uint4 codes (..., 2n) as uint8 (..., n), two to a byte (the first in the low bits)."""
    return jax.lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], -1, 2), jnp.uint8)


def unpack_nf4(packed: Array) -> Array:
    """`pack_nf4`'s inverse, as uint8 codes (shifts and masks: elementwise on every chip)."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], -1)


def scale_axes(
    axes: tuple[str | None, ...], shape: tuple[int, ...], scale_shape: tuple[int, ...]
) -> tuple[str | None, ...]:
    """A scale's logical axes: the weight's, None where the scale has one entry (reduced)."""
    return tuple(
        None if s == 1 and n != 1 else a for a, n, s in zip(axes, shape, scale_shape, strict=True)
    )


def is_quantized(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == {CODES, SCALE}


def dequantized(params: Params, base: FrozenBase) -> Params:
    """`params` with every frozen weight back in fp32 (quantized ones dequantized): the
    plain model's params, as exports and merges read them."""
    if not base.narrowed:
        return params

    def plain(node: Any) -> Any:
        if is_quantized(node):
            return dequantize(node[CODES], node[SCALE], base)
        if isinstance(node, dict):
            return {k: plain(v) for k, v in node.items()}
        return node.astype(jnp.float32)

    return plain(params)
