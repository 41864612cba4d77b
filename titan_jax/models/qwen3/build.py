"""A Qwen3 model as pure data + functions (the `ModelDef` of `titan_jax/models/spec.py`).

The trainer holds parameters as a plain nested dict of arrays (what optax, orbax and the HF
converter all want) and re-attaches them to the Flax module graph inside each function.
Dense Qwen3 has no buffers; MoE flavours keep each layer's expert bias (`expert_bias`, (L, E))
as one, updated from the tokens-per-expert counts of the aux channel. The aux channel also
carries per-layer activation statistics when asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from titan_jax.models.attention import resolve_attention
from titan_jax.models.frozen_base import FrozenBase
from titan_jax.models.frozen_weights import check_blocks, store_frozen
from titan_jax.models.qwen3.args import Qwen3Args
from titan_jax.models.qwen3.model import (
    ALWAYS_SAVED,
    SAVED_ACTIVATIONS,
    Kernels,
    Qwen3,
    stacked_logical_axes,
)
from titan_jax.models.qwen3.moe import expert_kernel_for, update_expert_bias
from titan_jax.models.remat import remat_policy
from titan_jax.models.sharding_hooks import pipeline_split
from titan_jax.models.spec import Aux, BuildOptions, HeadLoss, Params
from titan_jax.trees import leaf_name, nested_set

EXPERT_BIAS = "expert_bias"


@dataclasses.dataclass(frozen=True)
class Qwen3Def:
    """Qwen3's `ModelDef` (titan_jax/models/spec.py)."""

    args: Qwen3Args
    graphdef: nnx.GraphDef
    abstract_params: Params  # nested dict of jax.ShapeDtypeStruct (fp32 master weights)
    logical_axes: Params  # same tree, leaves are tuples of logical axis names
    options: BuildOptions = BuildOptions()
    abstract_buffers: Params = dataclasses.field(default_factory=dict)
    buffer_logical_axes: Params = dataclasses.field(default_factory=dict)
    trainable: frozenset[str] | None = None  # the LoRA adapters' names when there are any
    # The model with every weight in fp32 (a LoRA base stored below fp32 is not), its module
    # graph, and the logical axes of those params: what a base model's checkpoint holds.
    plain_params: Params = dataclasses.field(default_factory=dict)
    plain_logical_axes: Params = dataclasses.field(default_factory=dict)
    plain_graphdef: nnx.GraphDef | None = None

    @property
    def remat(self) -> Callable | None:
        o = self.options
        return remat_policy(
            o.remat_mode,
            o.save_gathered_params,
            SAVED_ACTIVATIONS,
            o.offload_layer_input,
            ALWAYS_SAVED,
        )

    def init(self, key: jax.Array) -> Params:
        """Random init (torchtitan's scheme, see model.py; LoRA adapters as PEFT's, from a
        key of their own). jit it with out_shardings to shard."""
        model = Qwen3(
            self.args, nnx.Rngs(params=key, lora=jax.random.fold_in(key, 1)), lora=self.options.lora
        )
        store_frozen(model, self.options.lora.base)
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def stored(self, params: Params) -> Params:
        """`params` of the plain model (`plain_params`: fp32, e.g. a HF base and fresh
        adapters) with the frozen base stored as the LoRA base says (as `init` stores it)."""
        if self.plain_graphdef is None:
            return params
        model = nnx.merge(self.plain_graphdef, params)
        store_frozen(model, self.options.lora.base)
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def init_buffers(self) -> Params:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.abstract_buffers)

    def forward(
        self,
        params: Params,
        buffers: Params,
        tokens_BT: jax.Array,
        dtype: DTypeLike = jnp.float32,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, Aux]:
        """(final hidden states (B, T, D), output projection (D, V), aux), for the loss;
        `dropout_key`: LoRA dropout on (training), None: off."""
        model = nnx.merge(self.graphdef, params)
        h_BTD, stats, aux_loss, _ = model.hidden_states(
            tokens_BT,
            dtype,
            self.remat,
            self.options.activation_stats,
            buffers.get(EXPERT_BIAS),
            lookahead=self.options.lookahead_gather,
            dropout_key=dropout_key,
        )
        return h_BTD, model.output_weight(dtype), {"loss": aux_loss, "stats": stats}

    def forward_loss(
        self,
        params: Params,
        buffers: Params,
        tokens_BT: jax.Array,
        labels_BT: jax.Array,
        head_loss: HeadLoss,
        dtype: DTypeLike = jnp.float32,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, Aux]:
        """(`head_loss` summed over the batch, aux); under the 1F1B pipeline schedule the loss
        runs inside the pipeline, per microbatch (`models/one_f_one_b.py`)."""
        split = pipeline_split()
        if split.degree == 1 or split.schedule != "1f1b":
            h_BTD, w_DV, aux = self.forward(params, buffers, tokens_BT, dtype, dropout_key)
            return head_loss(h_BTD, w_DV, labels_BT), aux
        loss, stats = nnx.merge(self.graphdef, params).one_f_one_b_loss(
            tokens_BT,
            labels_BT,
            head_loss,
            jnp.dtype(dtype),
            self.remat,
            self.options.activation_stats,
            buffers.get(EXPERT_BIAS),
            dropout_key,
        )
        return loss, {"loss": jnp.zeros((), jnp.float32), "stats": stats}

    def apply(
        self, params: Params, tokens_BT: jax.Array, dtype: DTypeLike = jnp.float32
    ) -> jax.Array:
        """Logits (B, T, V) in fp32; weights are read in `dtype` (with the build's remat)."""
        h_BTD, w_DV, _ = self.forward(params, self.init_buffers(), tokens_BT, dtype)
        return jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32)

    def aux_metrics(self, stats: dict[str, jax.Array], n_tokens: jax.Array) -> dict[str, jax.Array]:
        """Per-layer RMS of the residual stream after each block (`activation_stats`); for MoE,
        the busiest expert's load over the mean (worst layer) and the fraction of (layer,
        expert) pairs that got no token."""
        del n_tokens
        metrics = {}
        if "activation_sq_sum" in stats:
            metrics["activation_rms"] = jnp.sqrt(
                stats["activation_sq_sum"] / stats["activation_count"]
            )
        if "tokens_per_expert" in stats:
            counts = stats["tokens_per_expert"]
            metrics["moe_max_load"] = jnp.max(jnp.max(counts, -1) / jnp.mean(counts, -1))
            metrics["moe_idle_experts"] = jnp.mean((counts == 0).astype(jnp.float32))
        return metrics

    def update_buffers(self, buffers: Params, stats: dict[str, jax.Array]) -> Params:
        if EXPERT_BIAS not in buffers:
            return buffers
        return {
            EXPERT_BIAS: update_expert_bias(
                buffers[EXPERT_BIAS], stats["tokens_per_expert"], self.args.load_balance_coeff
            )
        }

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.plain_params))


def build_model_def(args: Qwen3Args, options: BuildOptions | None = None) -> Qwen3Def:
    """Traces the module once abstractly (no weights allocated) to get its structure."""
    options = options or BuildOptions()
    kernels = Kernels(
        expert_kernel_for(options.platform, options.quantization),
        resolve_attention(options.attention, options.platform),
        options.platform,
        options.quantization,
        options.expert_gather_before_router,
    )
    plain = nnx.eval_shape(lambda: Qwen3(args, nnx.Rngs(0), kernels, options.lora))
    plain_graphdef, plain_shapes, plain_axes, _ = _describe(plain)
    base = options.lora.base
    check_blocks(plain, base)
    stored = nnx.eval_shape(lambda: _stored(Qwen3(args, nnx.Rngs(0), kernels, options.lora), base))
    graphdef, shapes, axes, adapters = _describe(stored)
    buffers, buffer_axes = {}, {}
    if args.is_moe:  # non-trainable: never an nnx.Param, so never seen by the optimizer
        buffers[EXPERT_BIAS] = jax.ShapeDtypeStruct((args.n_layers, args.num_experts), jnp.float32)
        buffer_axes[EXPERT_BIAS] = ("layers", "expert")
    return Qwen3Def(
        args,
        graphdef,
        shapes,
        axes,
        options,
        buffers,
        buffer_axes,
        frozenset(adapters) if adapters else None,
        plain_shapes,
        plain_axes,
        plain_graphdef if base.narrowed else None,
    )


def _stored(model: Qwen3, base: FrozenBase) -> Qwen3:
    store_frozen(model, base)
    return model


def _describe(model: Qwen3) -> tuple[nnx.GraphDef, Params, Params, set[str]]:
    """(graph, abstract params, their logical axes, the LoRA adapters' names) of a model."""
    graphdef, state = nnx.split(model, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    shapes, axes, adapters = {}, {}, set()
    for path, var in flat:
        name = leaf_name(path)
        names = tuple(name.split("."))
        nested_set(shapes, names, jax.ShapeDtypeStruct(var.shape, var.dtype))
        nested_set(axes, names, stacked_logical_axes(names, var.logical_axes))
        if isinstance(var, nnx.LoRAParam):
            adapters.add(name)
    return graphdef, shapes, axes, adapters
