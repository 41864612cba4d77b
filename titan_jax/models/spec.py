"""The model interface: what training, checkpoints and tools need from a model family, and the
registry that maps `model.name` to it (TorchTitan's train specs).

A family registers one `ModelSpec`; `train/`, `tools/` and `parity/` only ever talk to a
`ModelDef` (built from a flavour's args) and to the spec (args class, FLOP count, HF adapter,
decoding), found by `model.name` or by the args in hand (`spec_of_args`), so another family
plugs in without touching them.

The forward returns `(hidden_BTD, output_weight_DV, aux)`. `aux` is the channel for everything
else a forward produces:
- `aux["loss"]`: a scalar added to the summed cross-entropy before it is divided by the global
  count of valid tokens (so a per-token auxiliary loss is contributed as its sum over tokens);
- `aux["stats"]`: arrays that are summed over microbatches and data shards, then handed to
  `ModelDef.aux_metrics` (for logging) and `ModelDef.update_buffers` (after the optimizer).
Non-trainable state (`buffers`, e.g. an MoE expert bias) lives beside the params in the train
state: declared with logical axes, sharded by the same rules, saved and restored by checkpoints,
never touched by the optimizer.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jax
from jax.typing import DTypeLike

from titan_jax.config_schema import ConfigError, Moe
from titan_jax.models.lora import NO_LORA, Lora
from titan_jax.models.quantization import NONE, Quantization
from titan_jax.yarn import YarnScaling

Params = dict[str, Any]
Aux = dict[str, Any]  # {"loss": scalar, "stats": {name: array}}
# (final hidden states (B, T, D), output projection (D, V), labels (B, T)) -> the summed loss
# of those rows: what `ModelDef.forward_loss` takes from the objective.
HeadLoss = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


class ModelArgs(Protocol):
    """A flavour's args, as family-agnostic code (run checks, planner, sharding) reads them: each
    family's frozen args dataclass (`ModelSpec.args_class`) has these fields. Read-only, as a
    frozen dataclass's fields are."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass (saved, replaced by field)

    @property
    def vocab_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def hidden_dim(self) -> int: ...  # a dense MLP's inner size
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def num_experts(self) -> int: ...  # 0: dense
    @property
    def top_k(self) -> int: ...  # experts per token (0: dense)
    @property
    def moe_inter_dim(self) -> int: ...  # an expert's inner size
    @property
    def is_moe(self) -> bool: ...

    def validate(self) -> None:
        """Raises ValueError naming the field where the sizes break the family's rules."""
        ...


class ModelDef(Protocol):
    """One built model: abstract shapes and logical axes of its params and buffers, and pure
    functions over them."""

    # Read-only (properties), as a frozen dataclass's fields are.
    @property
    def args(self) -> ModelArgs: ...
    @property
    def options(self) -> BuildOptions: ...  # how it was built
    @property
    def abstract_params(self) -> Params: ...  # ShapeDtypeStruct leaves (fp32 master weights)
    @property
    def logical_axes(self) -> Params: ...  # abstract_params' tree; tuples of logical axis names
    @property
    def abstract_buffers(self) -> Params: ...
    @property
    def buffer_logical_axes(self) -> Params: ...
    # Dotted names of the params the optimizer trains (LoRA: the adapters); None: every param.
    @property
    def trainable(self) -> frozenset[str] | None: ...
    # Every param in fp32 (a LoRA base stored in bf16 or quantized is not): what a base
    # model's checkpoint holds, and their logical axes.
    @property
    def plain_params(self) -> Params: ...
    @property
    def plain_logical_axes(self) -> Params: ...

    def stored(self, params: Params) -> Params:
        """Plain params (`plain_params`' tree) with the frozen base stored as the build's
        LoRA base says (identity for an fp32 base)."""
        ...

    def init(self, key: jax.Array) -> Params: ...

    def init_buffers(self) -> Params: ...

    def forward(
        self,
        params: Params,
        buffers: Params,
        tokens_BT: jax.Array,
        dtype: DTypeLike,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, Aux]:
        """`dropout_key`: the step's LoRA dropout key (training only; None: no dropout)."""
        ...

    def forward_loss(
        self,
        params: Params,
        buffers: Params,
        tokens_BT: jax.Array,
        labels_BT: jax.Array,
        head_loss: HeadLoss,
        dtype: DTypeLike,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, Aux]:
        """(`head_loss` of the forward's output summed over the batch, aux): `forward` then
        the loss, or both inside the pipeline when its schedule needs the loss there (1F1B,
        whose forward also computes the gradients)."""
        ...

    def apply(self, params: Params, tokens_BT: jax.Array, dtype: DTypeLike) -> jax.Array:
        """Logits (B, T, V) in fp32 (for parity and decoding; training never builds them)."""
        ...

    def aux_metrics(
        self, stats: dict[str, jax.Array], n_tokens: jax.Array
    ) -> dict[str, jax.Array]: ...

    def update_buffers(self, buffers: Params, stats: dict[str, jax.Array]) -> Params: ...

    def num_params(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How to build a model for training.

    remat_mode: activation checkpointing ("none" | "full" | "selective" | "offload").
    save_gathered_params: keep the gathered weights from forward for backward (SimpleFSDP
      reshard_after_forward=never) instead of gathering them again.
    activation_stats: report per-layer activation RMS through the aux channel.
    platform: "cpu", "tpu" or "gpu", the target devices' (not the host's) platform.
    attention: `model.attention` ("auto" picks by platform; see models/attention.py).
    lookahead_gather: gather each layer's weights one layer ahead in the layer scan
      (`models/lookahead.py`); full remat with re-gathering only.
    expert_gather_before_router: MoE layers gather their experts' w1 and w3 before routing
      (`models/qwen3/moe.py`), a schedule choice: the numbers are the same.
    quantization: which matmuls run in fp8 or int8 (`models/quantization.py`).
    offload_layer_input: each layer's input kept in host memory under remat (`remat.py`).
    lora: LoRA adapters beside the projections it names, the only params trained
      (`models/lora.py`).
    """

    remat_mode: str = "none"
    save_gathered_params: bool = True
    activation_stats: bool = False
    platform: str = "cpu"  # of the devices the model will run on, for kernel choices
    attention: str = "auto"
    lookahead_gather: bool = False
    expert_gather_before_router: bool = True
    quantization: Quantization = NONE
    offload_layer_input: bool = False
    lora: Lora = NO_LORA


class HFAdapter[A: ModelArgs](Protocol):
    """HF transformers checkpoints (config.json + safetensors) of one family: its key map and
    config translation (the files themselves are `models/safetensors_io.py`'s)."""

    def read_config(self, path: str | Path) -> A: ...  # a HF directory's config.json

    def load_params(self, path: str | Path, args: A, shardings: Params | None = None) -> Params: ...

    def save(
        self,
        path: str | Path,
        params: Params,
        args: A,
        dtype: str = "float32",
        max_shard_size: int | str = ...,
        *,
        overwrite: bool = False,
        source: str | Path | None = None,
    ) -> list[Path]:
        """The model as a HF directory (`source`: where it came from, for the messages);
        returns the files written."""
        ...

    def save_peft(
        self,
        path: str | Path,
        params: Params,
        args: A,
        lora: Lora,
        base_model: str | None = None,
        dtype: str = "float32",
        *,
        overwrite: bool = False,
        source: str | Path | None = None,
    ) -> list[Path]:
        """The LoRA adapters in `params` as a PEFT adapter directory."""
        ...

    def live_tensors(self, params: Params, args: A) -> dict[str, Any]:
        """Every tensor (e.g. gradients) under a live transformers model's parameter names."""
        ...


@dataclasses.dataclass(frozen=True)
class ArgsOverrides:
    """The run's choices a family applies to a flavour's args (`ModelSpec.configure`), built
    by the run's plan from the `[model]` and `[moe]` sections."""

    yarn: YarnScaling | None = None  # RoPE scaling; None keeps the args' own
    load_balance_coeff: float = Moe.load_balance_coeff  # MoE flavours only
    router_aux_loss_coef: float = Moe.router_aux_loss_coef


@dataclasses.dataclass(frozen=True)
class ModelSpec[A: ModelArgs]:
    name: str
    args_class: type[A]  # a frozen dataclass (saved as model_args in checkpoints)
    flavors: Mapping[str, A]
    build: Callable[..., ModelDef]  # (args, BuildOptions | None = None) -> ModelDef
    # Training FLOPs per token at a seq_len: (args, seq_len, lora=NO_LORA) -> FLOPs.
    flops_per_token: Callable[..., float]
    hf: HFAdapter[A]
    # KV-cached sampling: (params, args, prompt_BT, max_new_tokens, *, temperature, top_p,
    # seed, eos_id, dtype) -> tokens (B, T + n).
    generate: Callable[..., jax.Array]
    # The run's overrides applied to a flavour's args (e.g. the [moe] knobs); identity by default.
    configure: Callable[[A, ArgsOverrides], A] = lambda args, overrides: args
    display_name: str = ""  # for messages; defaults to `name`

    def __post_init__(self) -> None:
        if not self.display_name:
            object.__setattr__(self, "display_name", self.name)

    def flavor(self, name: str) -> A:
        return pick_flavor(self.display_name, self.flavors, name)


def pick_flavor[A](family: str, flavors: Mapping[str, A], name: str) -> A:
    """`flavors[name]`, or a ConfigError that suggests the nearest names."""
    if name not in flavors:
        by_lower = {k.lower(): k for k in flavors}
        close = (
            [by_lower[name.lower()]]
            if name.lower() in by_lower
            else (difflib.get_close_matches(name, flavors, n=3))
        )
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(
            f"model.flavor={name!r} is not a {family} flavour{hint}; valid: {', '.join(flavors)}"
        )
    return flavors[name]


# Families differ in their args class: the registry holds each spec whatever its `A`.
_REGISTRY: dict[str, ModelSpec[Any]] = {}


def spec_of_args(args: ModelArgs) -> ModelSpec[Any]:
    """The registered family whose flavours are `type(args)`."""
    for spec in _REGISTRY.values():
        if isinstance(args, spec.args_class):
            return spec
    raise ValueError(f"{type(args).__name__} is no registered model's args")


def register_model(spec: ModelSpec[Any]) -> None:
    _REGISTRY[spec.name] = spec


def registered_model(name: str) -> ModelSpec[Any]:
    """The registered family `name` (model.name), or a ConfigError listing the valid ones.
    Use `titan_jax.models.get_model_spec`, which registers the built-in families first."""
    if name not in _REGISTRY:
        raise ConfigError(
            f"model.name={name!r} is not a registered model; valid: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]
