"""The checks of a run that need more than the config alone, as plain functions that only
raise ConfigError (they return nothing and decide nothing), before anything is written or
allocated on devices: the model against the config and the mesh (from the abstract model:
shapes, heads, sequence lengths, nf4 blocks over their shards), the expert exchanges, the
attention kernel against the context-parallel split, the reduce dtype, the look-ahead gather
and layer-input offload, and the data (the tokenizer against the model, every input).

`config.validate` checks the config by itself when it is loaded (types, ranges, one field
against another). The decisions are `plan_decisions`', `parallel.mesh.resolve_degrees`',
`pipeline_plan.plan_pipeline`'s and `simple_fsdp.choose_implementation`'s (each refuses what it
cannot decide): `run_plan.plan_run` makes them in order and calls each check here as it makes
the decision it checks, and `setup.assemble_run` the data checks after it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import Mesh

from titan_jax.config import ConfigError, JobConfig, Moe, Parallelism
from titan_jax.data.pipeline import check_inputs
from titan_jax.data.tokenizer import Tokenizer
from titan_jax.models import ModelArgs, ModelDef
from titan_jax.models.attention import CP_ATTENTION, SPLASH_BLOCKS
from titan_jax.models.frozen_base import CODES, SCALE, is_quantized
from titan_jax.parallel.context_parallel import check_seq_len
from titan_jax.parallel.mesh import MeshDegrees
from titan_jax.parallel.rules import (
    MeshAxes,
    ShardingRuleError,
    ShardingRules,
    axes_tuple,
    mesh_axes_of,
    table_with_overrides,
)
from titan_jax.parallel.simple_fsdp import SimpleFSDP
from titan_jax.train.plan_decisions import expert_rows
from titan_jax.trees import named_leaves, nested_get


def check_moe_knobs(config: JobConfig, args: ModelArgs) -> None:
    """`[moe]` keys, and `parallelism.fsdp_expert_gather_before_router`, changed from their
    defaults on a dense flavour are refused, as an expert degree is: nothing reads them there.
    (A value equal to its default changes nothing, set or not: it is not told apart.)"""
    if args.is_moe:
        return
    changed = [
        f"moe.{f.name}={getattr(config.moe, f.name)}"
        for f in dataclasses.fields(Moe)
        if getattr(config.moe, f.name) != f.default
    ]
    if changed:
        raise ConfigError(
            f"{changed[0]} applies to MoE flavours only; model.flavor="
            f"{config.model.flavor} is dense (leave [moe] out)"
        )
    gather = config.parallelism.fsdp_expert_gather_before_router
    if gather != Parallelism.fsdp_expert_gather_before_router:
        raise ConfigError(
            f"parallelism.fsdp_expert_gather_before_router={str(gather).lower()} "
            f"applies to MoE flavours only; model.flavor={config.model.flavor} is "
            "dense (leave it out)"
        )


def check_lookahead_gather(config: JobConfig, fsdp: type[SimpleFSDP], attention: str) -> None:
    """The look-ahead gather's scan recomputes each layer in backward from its input and its
    re-gathered weights (models/lookahead.py): full remat, re-sharded after forward. On the
    jit path the splash kernel's per-shard shard_map does not trace in that backward
    (`SimpleFSDP.hosts_splash_lookahead`)."""
    p = config.parallelism
    if not p.fsdp_lookahead_gather:
        return
    mode = config.activation_checkpoint.mode
    if mode != "full" or p.fsdp_reshard_after_forward == "never":
        raise ConfigError(
            "parallelism.fsdp_lookahead_gather=true needs activation_checkpoint.mode=full and "
            f"parallelism.fsdp_reshard_after_forward default or always (got mode={mode}, "
            f"fsdp_reshard_after_forward={p.fsdp_reshard_after_forward})"
        )
    if attention == "splash" and not fsdp.hosts_splash_lookahead:
        raise ConfigError(
            "parallelism.fsdp_lookahead_gather=true with splash attention needs "
            "parallelism.fsdp_implementation=shard_map (or model.attention=xla)"
        )


def check_one_f_one_b(config: JobConfig, degrees: MeshDegrees, fsdp: type[SimpleFSDP]) -> None:
    """The 1F1B pipeline (models/one_f_one_b.py) beside tensor parallelism aborts XLA's SPMD
    partitioner inside the shard_map implementation (`SimpleFSDP.hosts_one_f_one_b_with_tp`)."""
    p = config.parallelism
    if p.pipeline_parallel_schedule != "1f1b" or degrees.pp == 1 or degrees.tp == 1:
        return
    if not fsdp.hosts_one_f_one_b_with_tp:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule=1f1b with tensor_parallel_degree={degrees.tp} "
            "needs parallelism.fsdp_implementation=jit (or pipeline_parallel_schedule=gpipe)"
        )


def check_pipeline_kernels(
    config: JobConfig,
    degrees: MeshDegrees,
    fsdp: type[SimpleFSDP],
    attention: str,
    args: ModelArgs,
    platform: str,
) -> None:
    """Pallas TPU kernels (splash attention; megablox, the experts' kernels on TPU) inside
    pipeline stages need a schedule whose stages host them on the implementation
    (`SimpleFSDP.tpu_kernel_pipeline_schedules`)."""
    schedule = config.parallelism.pipeline_parallel_schedule
    if degrees.pp == 1 or platform != "tpu" or schedule in fsdp.tpu_kernel_pipeline_schedules:
        return
    pp = f"parallelism.pipeline_parallel_schedule={schedule}"
    if args.is_moe:  # MoE on TPU takes the shard_map implementation (choose_implementation)
        raise ConfigError(
            f"{pp} cannot pipeline a MoE model on TPU (its expert kernels do not lower inside "
            "its stages); set parallelism.pipeline_parallel_schedule=gpipe"
        )
    if attention == "splash":
        jit = ", parallelism.fsdp_implementation=jit" if degrees.cp == 1 else ""
        raise ConfigError(
            f"{pp} with splash attention needs parallelism.pipeline_parallel_schedule=gpipe"
            f"{jit} or model.attention=xla (the splash kernel does not lower inside its stages "
            f"on fsdp_implementation={fsdp.implementation})"
        )


def check_layer_input_offload(config: JobConfig) -> None:
    """A layer's input is offloaded by the layer scan's remat policy: there is none without
    remat, and the look-ahead gather's scan remats on its own."""
    a = config.activation_checkpoint
    if not a.offload_layer_input:
        return
    if a.mode == "none":
        raise ConfigError(
            "activation_checkpoint.offload_layer_input=true needs a remat mode "
            "(activation_checkpoint.mode full, selective or offload; got none)"
        )
    if config.parallelism.fsdp_lookahead_gather:
        raise ConfigError(
            "activation_checkpoint.offload_layer_input=true does not combine "
            "with parallelism.fsdp_lookahead_gather=true (set one false)"
        )


def check_model_fits(config: JobConfig, args: ModelArgs) -> None:
    """The `[moe]` keys apply, and every sequence length fits the model's positions."""
    check_moe_knobs(config, args)
    lengths = {"training": config.training.seq_len}
    if config.validation.enable:
        lengths["validation"] = config.validation.seq_len
    for section, n in lengths.items():
        if n > args.max_seq_len:
            raise ConfigError(
                f"{section}.seq_len={n} exceeds the maximum sequence length "
                f"{args.max_seq_len} of model.flavor={config.model.flavor}"
            )


def check_sharding_rules(config: JobConfig, mesh: Mesh) -> None:
    """The recipe's `parallelism.sharding_rules` name logical axes of the table and axes of
    the mesh."""
    try:
        ShardingRules(mesh, table_with_overrides(config.parallelism.sharding_rules))
    except ShardingRuleError as e:
        raise ConfigError(
            str(e) if str(e).startswith("parallelism.") else f"parallelism.sharding_rules: {e}"
        ) from None


def check_heads(
    config: JobConfig, args: ModelArgs, degrees: MeshDegrees, table: Mapping[str, MeshAxes]
) -> None:
    """Tensor parallelism divides the attention heads and the K/V heads, where the table splits
    them over tp (a recipe may keep the K/V heads whole: `kv_heads = []`)."""
    split = {
        name: n
        for name, n in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads))
        if "tp" in axes_tuple(table.get(name[2:]))
    }
    if any(n % degrees.tp for n in split.values()):
        hint = (
            " (or keep the K/V heads whole over tp: parallelism.sharding_rules kv_heads=)"
            if args.n_heads % degrees.tp == 0
            else ""
        )
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={degrees.tp} must divide "
            f"{' and '.join(f'{k}={v}' for k, v in split.items())} of "
            f"model.flavor={config.model.flavor}{hint}"
        )


def check_expert_chunks(config: JobConfig, args: ModelArgs, degrees: MeshDegrees) -> None:
    """`parallelism.expert_parallel_chunks` splits each device's picks of a microbatch (and of
    a validation batch) into equal exchanges, under expert parallelism."""
    chunks = config.parallelism.expert_parallel_chunks
    if chunks == 1:
        return
    if degrees.ep == 1:
        raise ConfigError(
            f"parallelism.expert_parallel_chunks={chunks} pipelines expert "
            "parallelism's exchanges; parallelism.expert_parallel_degree is 1 "
            "(use 1)"
        )
    batches = [("micro", config.training)] + (
        [("validation ", config.validation)] if config.validation.enable else []
    )
    picks = {
        name: expert_rows(b.local_batch_size, b.seq_len, degrees.cp, args) for name, b in batches
    }
    for name, n in picks.items():
        if n % chunks:
            # the hint must hold for every batch, not only the one refused
            fits = divisor_below(math.gcd(*picks.values()), chunks)
            raise ConfigError(
                f"parallelism.expert_parallel_chunks={chunks} must divide each device's "
                f"{n} picks a {name}batch (local_batch_size x seq_len / cp x top_k); use {fits}"
            )


def divisor_below(n: int, bound: int, tries: int = 1 << 16) -> int:
    """A divisor of `n` (>= 1) below `bound`, for a hint: the largest one when n <= tries**2
    (every pair d, n // d is then seen), else the largest of the pairs with d <= tries. The
    work stays bounded whatever the numbers: a user's `bound` of 10**9 must not loop 10**9
    times."""
    if n < bound:
        return n
    best = 1
    for d in range(1, min(math.isqrt(n), tries) + 1):
        if n % d == 0:
            best = max([best, *(x for x in (d, n // d) if x < bound)])
    return best


def check_reduce_dtype(
    config: JobConfig, devices: list[jax.Device], fsdp: type[SimpleFSDP]
) -> None:
    if (
        config.training.mixed_precision_reduce == "bfloat16"
        and not fsdp.reduces_in_bf16_on_cpu
        and all(d.platform == "cpu" for d in devices)
    ):
        raise ConfigError(  # SimpleFSDP.reduces_in_bf16_on_cpu
            "training.mixed_precision_reduce=bfloat16 with parallelism.fsdp_implementation="
            "shard_map does not compile on CPU devices; use float32, or the jit implementation"
        )


def check_context_parallel(
    cp: int, seq_lens: dict[str, int], choice: str, attention: str, method: str = "allgather"
) -> None:
    """Sequences cp can split, and an attention kernel (`attention`, what `choice` resolved
    to: `plan_decisions.resolve_run_attention`) that takes the split."""
    if cp > 1 and method == "ring" and choice not in ("auto", "xla"):
        raise ConfigError(
            f"model.attention={choice} cannot run with parallelism.context_parallel_method"
            "=ring (its blocks are XLA einsums with an online softmax); use auto or xla, "
            "or context_parallel_method=allgather"
        )
    for field, n in seq_lens.items():
        check_seq_len(n, cp, field)
        if cp > 1 and attention == "splash" and (n // (2 * cp)) % SPLASH_BLOCKS[-1]:
            raise ConfigError(
                f"{field}={n} must be a multiple of 2 x parallelism.context_parallel_degree x "
                f"{SPLASH_BLOCKS[-1]} = {2 * cp * SPLASH_BLOCKS[-1]} for model.attention="
                f"splash (each rank's two chunks are tiled by its blocks); or use "
                "model.attention=xla"
            )
    if cp > 1 and attention not in CP_ATTENTION:
        raise ConfigError(
            f"model.attention={choice} (resolved: {attention}) cannot run with parallelism."
            f"context_parallel_degree={cp}; use {' or '.join(CP_ATTENTION)}"
        )


def check_base_blocks(config: JobConfig, rules: ShardingRules, model: ModelDef) -> None:
    """An nf4 base's scales are split like the input dim they tile (a block count per shard):
    every weight's block count must divide over its shards; refused with the largest block
    size that divides them all."""
    if config.lora.rank == 0 or config.lora.base_dtype != "nf4":
        return
    tiled = []  # (weight, input dim, blocks, shards)
    for name, node in named_leaves(model.abstract_params, is_leaf=is_quantized).items():
        if not is_quantized(node):
            continue
        axes = nested_get(model.logical_axes, (*name.split("."), SCALE))
        codes, scale = node[CODES].shape, node[SCALE].shape
        for d in range(len(codes) - 1):  # the last dim is an output (and packed)
            if 1 < scale[d] < codes[d]:
                shards = math.prod(
                    rules.mesh.shape[a]
                    for a in mesh_axes_of(rules.weight_layout((axes[d],)).storage)
                )
                tiled.append((name, codes[d], scale[d], shards))
    bad = next(((n, dim, blocks, k) for n, dim, blocks, k in tiled if blocks % k), None)
    if bad is None:
        return
    name, dim, blocks, shards = bad
    fits = next(
        (
            b
            for b in range(config.lora.base_block_size - 1, 0, -1)
            if all(d % b == 0 and (d == b or (d // b) % k == 0) for _, d, _, k in tiled)
        ),
        None,
    )
    smaller = f"lora.base_block_size={fits}, or " if fits else ""
    raise ConfigError(
        f"lora.base_block_size={config.lora.base_block_size}: the {blocks} nf4 blocks of "
        f"{name}'s input dim ({dim}) do not split over its {shards} shards; use {smaller}"
        "lora.base_dtype=int8"
    )


def check_data(config: JobConfig, args: ModelArgs, attention: str, tokenizer: Tokenizer) -> None:
    """The run's tokenizer fits the model's vocabulary, and every input exists."""
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"tokenizer {config.model.tokenizer_path or '(shipped)'} has vocab size "
            f"{tokenizer.vocab_size}, larger than model.flavor={config.model.flavor}'s "
            f"vocab_size={args.vocab_size}"
        )
    if config.training.document_mask and attention == "cudnn":
        raise ConfigError(
            "training.document_mask=true needs model.attention=xla or splash: "
            "the cudnn attention here takes no segment ids"
        )
    check_inputs(config, tokenizer)
