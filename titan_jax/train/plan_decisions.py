"""The decisions `run_plan.plan_run` makes that take more than a line, one function each: each
returns what it decides for this run (the model, its args overrides, the microbatches, the
low-precision matmuls, the attention kernel, the LoRA targets, every array's storage layout)
and raises ConfigError where the config cannot be met. The numbers several decisions and checks
share (a device's expert rows, the tokens that travel with the vocabulary) are computed here
once. Checks that decide nothing are `run_checks`'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.config import ConfigError, JobConfig, Training, yarn_of
from titan_jax.config_schema import LORA_GROUPS
from titan_jax.models import ArgsOverrides, ModelArgs, ModelDef, ModelSpec, get_model_spec
from titan_jax.models.attention import resolve_attention
from titan_jax.models.frozen_base import FrozenBase
from titan_jax.models.lora import NO_LORA, Lora
from titan_jax.models.quantization import NONE, Quantization
from titan_jax.parallel.mesh import MeshDegrees
from titan_jax.parallel.rules import ShardingRuleError, ShardingRules


def model_choice(config: JobConfig) -> tuple[ModelSpec[ModelArgs], ModelArgs]:
    """(the family `model.name`, its `model.flavor` args); an unknown name or flavour is a
    ConfigError naming the valid ones."""
    spec = get_model_spec(config.model.name)
    return spec, spec.flavor(config.model.flavor)


def args_overrides(config: JobConfig) -> ArgsOverrides:
    """What the `[model]` RoPE keys and the `[moe]` knobs change in a flavour's args."""
    return ArgsOverrides(
        yarn=yarn_of(config.model) if config.model.rope_type == "yarn" else None,
        load_balance_coeff=config.moe.load_balance_coeff,
        router_aux_loss_coef=config.moe.router_aux_loss_coef,
    )


def expert_rows(local_batch_size: int, seq_len: int, cp: int, args: ModelArgs) -> int:
    """Rows a device's expert kernels take from one batch of `local_batch_size` x `seq_len`
    per data-parallel rank: its tokens (cp splits each sequence) times `top_k`, the experts
    each token picks. Each rank receives as many as it sends at balanced routing."""
    return local_batch_size * seq_len // cp * args.top_k


def travelling_tokens(t: Training, degrees: MeshDegrees) -> int:
    """The tokens of one microbatch over the shards that split the vocabulary (cp splits the
    same rows' positions; tp ranks share their tokens)."""
    return t.local_batch_size * t.seq_len * degrees.fsdp * degrees.ep


def run_seq_lens(config: JobConfig) -> dict[str, int]:
    """Every sequence length the run uses, by its field."""
    seq_lens = {"training.seq_len": config.training.seq_len}
    if config.validation.enable:
        seq_lens["validation.seq_len"] = config.validation.seq_len
    return seq_lens


def microbatches(config: JobConfig, degrees: MeshDegrees) -> int:
    """Microbatches per optimizer step: the global batch over one data-parallel pass."""
    t = config.training
    per_step = t.local_batch_size * degrees.dp
    global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_step:
        raise ConfigError(
            f"training.global_batch_size={global_batch} must be a multiple of "
            f"local_batch_size x data-parallel degree = {t.local_batch_size} x {degrees.dp}"
        )
    return global_batch // per_step


# Where each mode has a fast path: fp8 on Ironwood (TPU7x, "the first TPUs" with fp8 in
# their MXUs; v5p/v6e list fp8 at their bf16 rate, v5e none) and on NVIDIA GPUs from compute
# capability 8.9 (Ada, Hopper, Blackwell); int8 on TPU v4-v6e (twice their bf16 rate on
# v5e/v6e). CPU devices run both emulated, for tests.
def _takes(mode: str, device: jax.Device) -> bool:
    kind = device.device_kind
    if device.platform == "cpu":
        return True
    if device.platform == "tpu":
        return (
            kind.startswith("TPU7")
            if mode == "fp8"
            else kind.startswith(("TPU v4", "TPU v5", "TPU v6"))
        )
    capability = float(getattr(device, "compute_capability", "0") or 0)
    return mode == "fp8" and capability >= 8.9


def resolve_quantization(
    config: JobConfig, args: ModelArgs, degrees: MeshDegrees, devices: list[jax.Device]
) -> Quantization:
    """`[quantize]` for this run's devices and model: refused where the model has none of the
    groups named, the chip has no fast path for the mode, the experts are smaller than the TPU
    kernel takes, or a block does not divide a contracted dimension."""
    q = config.quantize
    if q.mode == "none":
        return NONE
    device, names = devices[0], q.module_names()
    moe = args.is_moe
    present = ("attention", "experts" if moe else "mlp")  # a MoE layer has no dense SwiGLU
    if not set(names) & set(present):
        missing = "experts" if not moe else "dense mlp (its feed-forward is the experts)"
        raise ConfigError(
            f"quantize.modules={q.modules!r}: model.flavor={config.model.flavor} is "
            f"{'MoE' if moe else 'dense'} and has no {missing}, so nothing would run in "
            f"{q.mode}; name some of {','.join(present)}, or set quantize.mode=none"
        )
    if not _takes(q.mode, device):
        other = "int8" if q.mode == "fp8" else "fp8"
        hint = f"use quantize.mode={other}" if _takes(other, device) else "use quantize.mode=none"
        raise ConfigError(
            f"quantize.mode={q.mode}: {device.device_kind} has no {q.mode} matmul units (fp8: "
            f"TPU7x, NVIDIA from compute capability 8.9; int8: TPU v4-v6e); {hint}"
        )
    if moe and "experts" in names and q.scaling != "rowwise":  # a dense model has none
        raise ConfigError(
            f"quantize.scaling={q.scaling}: the experts' grouped matmuls take rowwise scales "
            "only (qwix's ragged_dot); use quantize.scaling=rowwise, or leave experts out of "
            "quantize.modules"
        )
    if moe and "experts" in names and device.platform == "tpu":
        t = config.training
        small = {
            "model dim": args.dim,
            "expert hidden dim per tensor-parallel rank": args.moe_inter_dim // degrees.tp,
            "number of expert rows per device (local_batch_size x seq_len / cp x top_k)": (
                expert_rows(t.local_batch_size, t.seq_len, degrees.cp, args)
            ),
        }
        for name, n in small.items():
            if n < 128:
                raise ConfigError(
                    f"quantize.modules={q.modules!r}: the quantized expert kernel on TPU "
                    f"(tokamax's) needs a {name} of at least 128, not {n}; leave experts out "
                    "of quantize.modules"
                )
    if q.scaling == "blockwise":
        rows = config.training.seq_len // degrees.cp
        dims = {
            "model dim": args.dim,
            "head_dim": args.head_dim,
            "tokens per sequence (per context-parallel rank)": rows,
        }
        if "mlp" in names and not moe:
            dims["hidden_dim"] = args.hidden_dim
        bad = {name: n for name, n in dims.items() if n % q.block_size}
        if bad:
            name, n = next(iter(bad.items()))
            raise ConfigError(
                f"quantize.block_size={q.block_size} must divide the {name} ({n}) the blockwise "
                "scales tile; choose a divisor, or quantize.scaling=rowwise"
            )
    return Quantization(
        q.mode, tuple(n for n in names if n != "experts" or moe), q.scaling, q.block_size, q.gather
    )


def resolve_lora(config: JobConfig, args: ModelArgs, param_dtype: Any = jnp.float32) -> Lora:
    """`[lora]` for this model: the projections its targets name that the model has (a MoE
    layer has experts, not a dense SwiGLU; a dense one no experts); refused where they name
    none of them, as PEFT refuses. `lora.base_dtype=auto` stores the frozen base in the
    run's `param_dtype`."""
    lo = config.lora
    if lo.rank == 0:
        return NO_LORA
    moe = args.is_moe
    groups = ("attention", "experts" if moe else "mlp")
    present = tuple(n for g in groups for n in LORA_GROUPS[g])
    projections = tuple(n for n in lo.projections() if n in present)
    if not projections:
        kind = "MoE (its feed-forward is the experts)" if moe else "dense (it has no experts)"
        raise ConfigError(
            f"lora.target_modules={lo.target_modules!r} matches no projection of model.flavor="
            f"{config.model.flavor}, which is {kind}; name some of "
            f"{','.join(groups)},{','.join(present)}"
        )
    base_dtype = jnp.dtype(param_dtype).name if lo.base_dtype == "auto" else lo.base_dtype
    return Lora(
        lo.rank, lo.alpha, projections, lo.dropout, FrozenBase(base_dtype, lo.base_block_size)
    )


def resolve_run_attention(config: JobConfig, cp: int, platform: str, dtype: jnp.dtype) -> str:
    """The kernel `model.attention` means for this run (its devices, compute dtype, every
    sequence length it uses and the context-parallel method): resolved once, here; whether cp
    can take it is `run_checks.check_context_parallel`'s."""
    attention = resolve_attention(config.model.attention, platform, dtype, run_seq_lens(config))
    return context_parallel_kernel(attention, cp, config.parallelism.context_parallel_method)


def context_parallel_kernel(attention: str, cp: int, method: str) -> str:
    """The kernel that runs under context parallelism: the ring's blocks are XLA einsums with
    an online softmax, whatever `auto` resolved to."""
    return "xla" if cp > 1 and method == "ring" else attention


def storage_specs(config: JobConfig, rules: ShardingRules, model: ModelDef) -> tuple[Any, Any]:
    """Every param's and buffer's storage layout, checked against its shape and named on
    error."""
    try:
        return (
            rules.storage_specs(model.abstract_params, model.logical_axes),
            rules.storage_specs(model.abstract_buffers, model.buffer_logical_axes),
        )
    except ShardingRuleError as e:
        raise ConfigError(
            f"cannot shard model.flavor={config.model.flavor} on this mesh: {e}"
        ) from None
