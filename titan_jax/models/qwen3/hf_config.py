"""HF transformers `config.json` <-> Qwen3Args, and the check that a checkpoint fits a model."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from titan_jax.models.qwen3.args import MAX_SIZE, Qwen3Args, YarnScaling
from titan_jax.models.safetensors_io import HFCheckpointError

CONFIG_FILE = "config.json"
# model_type -> architecture: dense Qwen3 and Qwen3-MoE.
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Fields compared between a checkpoint's config.json and the model it is loaded into
# (max_seq_len is a training choice, not a property of the weights).
_WEIGHT_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "hidden_dim",
    "vocab_size",
    "norm_eps",
    "rope_theta",
    "tie_embeddings",
    "num_experts",
    "top_k",
    "moe_inter_dim",
    "norm_topk_prob",
)


# ------------------------------------------------------------------------------------------------
# config.json <-> Qwen3Args


def _field(config: dict[str, Any], where: str, name: str, kind: type, default: Any = None) -> Any:
    """config[name] as `kind` (an int widens to float), `default` when absent or null. Every
    int here is a size, in [1, MAX_SIZE]; every float a finite number >= 0: checked before
    anything is built from them (a tampered count would allocate without bound)."""
    value = config.get(name)
    value = default if value is None else value  # HF writes null for "use the default"
    if value is None:
        raise HFCheckpointError(f"{where}: missing field {name!r}")
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:  # `type is`: a JSON true is not an int
        raise HFCheckpointError(f"{where}: {name}={value!r} is not of type {kind.__name__}")
    if kind is int and not 1 <= value <= MAX_SIZE:
        raise HFCheckpointError(f"{where}: {name}={value} must be in [1, {MAX_SIZE}]")
    if kind is float and not (math.isfinite(value) and value >= 0):
        raise HFCheckpointError(f"{where}: {name}={value} must be a finite number >= 0")
    return value


def _model_type(config: Any, where: str) -> str:
    """A Qwen3 or Qwen3-MoE config's model_type; other architectures and variants are errors."""
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{where}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFCheckpointError(
            f"{where}: model_type={model_type!r} is not a Qwen3 or Qwen3-MoE checkpoint "
            f"(expected one of {', '.join(map(repr, ARCHITECTURES))})"
        )
    archs, arch = config.get("architectures"), ARCHITECTURES[model_type]
    if archs is not None and arch not in archs:
        raise HFCheckpointError(f"{where}: architectures={archs!r}; expected [{arch!r}]")
    for name, supported in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("use_sliding_window", False),
    ):
        if name in config and config[name] != supported:
            raise HFCheckpointError(
                f"{where}: {name}={config[name]!r} is not supported (Qwen3 uses {supported!r})"
            )
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise HFCheckpointError(
            f"{where}: layer_types={layer_types!r}; only full_attention layers are supported"
        )
    return model_type


def _moe_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """Qwen3Args' MoE fields of a qwen3_moe config."""
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise HFCheckpointError(
            f"{where}: decoder_sparse_step={config.get('decoder_sparse_step')!r}, "
            f"mlp_only_layers={config.get('mlp_only_layers')!r}: only all-MoE layers "
            "(1, []) are supported"
        )
    field = functools.partial(_field, config, where)
    # The hub's files say num_experts; transformers 5 writes num_local_experts.
    experts = "num_experts" if config.get("num_experts") is not None else "num_local_experts"
    return {
        "num_experts": field(experts, int),
        "top_k": field("num_experts_per_tok", int),
        "moe_inter_dim": field("moe_intermediate_size", int),
        "norm_topk_prob": field("norm_topk_prob", bool, False),
        # HF adds its auxiliary loss only when the router logits are output.
        "router_aux_loss_coef": field("router_aux_loss_coef", float, 0.0)
        if config.get("output_router_logits")
        else 0.0,
    }


def args_from_hf_config(config: dict[str, Any], where: str = CONFIG_FILE) -> Qwen3Args:
    """Qwen3Args from a HF config.json dict; other architectures and variants are errors."""
    model_type = _model_type(config, where)
    theta, yarn = _rope_from_config(config, where)
    moe = _moe_fields(config, where) if model_type == "qwen3_moe" else {}
    field = functools.partial(_field, config, where)
    dim = field("hidden_size", int)
    n_heads = field("num_attention_heads", int)
    norm_eps = field("rms_norm_eps", float, 1e-6)
    if norm_eps == 0:
        raise HFCheckpointError(f"{where}: rms_norm_eps=0.0 must be > 0")
    args = Qwen3Args(
        dim=dim,
        n_layers=field("num_hidden_layers", int),
        n_heads=n_heads,
        n_kv_heads=field("num_key_value_heads", int, n_heads),
        head_dim=field("head_dim", int, dim // n_heads),
        hidden_dim=field("intermediate_size", int),
        vocab_size=field("vocab_size", int),
        norm_eps=norm_eps,
        rope_theta=theta,
        max_seq_len=field("max_position_embeddings", int, 32768),
        yarn=yarn,
        tie_embeddings=field("tie_word_embeddings", bool, False),
        **moe,
    )
    try:
        args.validate()
    except ValueError as e:
        raise HFCheckpointError(f"{where}: {e}") from None
    return args


def _rope_from_config(config: dict[str, Any], where: str) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) from transformers 5's `rope_parameters` or older
    files' `rope_scaling` (rope_theta at the top level); HF's defaults fill the gaps."""
    # As transformers 5 reads them: a non-empty rope_scaling wins over rope_parameters.
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise HFCheckpointError(f"{where}: {key}={rope!r} is not an object")
    # transformers 5 keeps rope_theta in rope_parameters; older files have it at the top level.
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise HFCheckpointError(f"{where}: rope_theta={theta!r} is not a number")
    if not (math.isfinite(theta) and theta > 1):  # frequencies are theta ** (-i / d)
        raise HFCheckpointError(f"{where}: rope_theta={theta} must be a finite number > 1")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn":
        raise HFCheckpointError(
            f"{where}: {key}.rope_type={rope_type!r} is not supported (only 'default' and 'yarn')"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFCheckpointError(
            f"{where}: {key}.partial_rotary_factor="
            f"{rope['partial_rotary_factor']!r} is not supported (Qwen3: 1)"
        )

    def number(name: str) -> float | None:
        value = rope.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise HFCheckpointError(f"{where}: {key}.{name}={value!r} is not a number")
        if value is not None and not math.isfinite(value):
            raise HFCheckpointError(f"{where}: {key}.{name}={value} must be a finite number")
        return value

    max_len = _field(config, where, "max_position_embeddings", int, 32768)
    original = number("original_max_position_embeddings")
    original = max_len if original is None else original
    if not (original == int(original) and 1 <= original <= MAX_SIZE):
        raise HFCheckpointError(
            f"{where}: {key}.original_max_position_embeddings={original} "
            f"must be a whole number in [1, {MAX_SIZE}]"
        )
    original = int(original)
    factor = float(number("factor") or max_len / original)
    attention = number("attention_factor")
    mscale, mscale_all_dim = number("mscale"), number("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:  # DeepSeek's form of the same factor
        m = lambda s: 1.0 if factor <= 1 else 0.1 * s * math.log(factor) + 1.0  # noqa: E731
        attention = m(mscale) / m(mscale_all_dim)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise HFCheckpointError(f"{where}: {key}.truncate={truncate!r} is not true or false")
    yarn = YarnScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(number("beta_fast") or 32.0),
        beta_slow=float(number("beta_slow") or 1.0),
        attention_factor=float(attention or 0.0),
        truncate=truncate,
    )
    try:
        yarn.validate(prefix=f"{key}.")
    except ValueError as e:
        raise HFCheckpointError(f"{where}: {e}") from None
    return float(theta), yarn


def _rope_parameters(args: Qwen3Args) -> dict[str, Any]:
    """`rope_parameters` as transformers 5 writes them."""
    if args.yarn is None:
        return {"rope_theta": args.rope_theta, "rope_type": "default"}
    y = args.yarn
    extra = {"attention_factor": y.attention_factor} if y.attention_factor else {}
    return {
        "rope_theta": args.rope_theta,
        "rope_type": "yarn",
        "factor": y.factor,
        "original_max_position_embeddings": y.original_max_position_embeddings,
        "beta_fast": y.beta_fast,
        "beta_slow": y.beta_slow,
        "truncate": y.truncate,
        **extra,
    }


def hf_config_from_args(args: Qwen3Args, dtype: str = "float32") -> dict[str, Any]:
    """The config.json transformers writes for this model (readable by transformers 4 and 5)."""
    model_type = "qwen3_moe" if args.is_moe else "qwen3"
    moe = (
        {
            "num_experts": args.num_experts,
            "num_local_experts": args.num_experts,
            "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": args.moe_inter_dim,
            "norm_topk_prob": args.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": args.router_aux_loss_coef > 0,
            "router_aux_loss_coef": args.router_aux_loss_coef,
        }
        if args.is_moe
        else {}
    )
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **moe,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.hidden_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "rope_parameters": _rope_parameters(args),
        "rope_theta": args.rope_theta,  # transformers 4 reads it here
        "dtype": dtype,
    }


def read_hf_config(path: str | Path) -> Qwen3Args:
    """Qwen3Args of the HF model directory `path` (from its config.json)."""
    file = Path(path) / CONFIG_FILE
    if not Path(path).exists():
        raise HFCheckpointError(f"HF model directory {path} does not exist")
    if not file.is_file():
        raise HFCheckpointError(f"{path}: no {CONFIG_FILE} (not a HF model directory)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{file}: not valid JSON: {e}") from None
    return args_from_hf_config(config, str(file))


def check_args_match(args: Qwen3Args, checkpoint: Qwen3Args, where: str) -> None:
    """The checkpoint's weights fit `args`: every shape/numerics field agrees."""
    # An all-MoE model has no dense FFN: config.json's intermediate_size describes no weight.
    fields = [f for f in _WEIGHT_FIELDS if not (f == "hidden_dim" and args.is_moe)]
    diffs = [
        f"{f}: checkpoint {getattr(checkpoint, f)!r} vs model {getattr(args, f)!r}"
        for f in fields
        if getattr(args, f) != getattr(checkpoint, f)
    ]
    if diffs:
        raise HFCheckpointError(f"{where} does not match the model: " + "; ".join(diffs))
