"""Every decision a run makes about its model and devices, made once, in order, by `plan_run`.

config -> model family and args -> degrees and mesh -> pipeline stages (`pipeline_plan`) ->
microbatches -> low precision -> SimpleFSDP's implementation -> dtypes -> attention kernel ->
LoRA targets -> the model (abstract) -> the rules table and every array's storage layout. The
decisions that take more than a line are `plan_decisions`' functions (each returns its
decision); each is checked as it is made by `run_checks`' plain functions, which only raise
ConfigError. The result is a frozen `RunPlan` holding every decision and the numbers derived
from them, from which `trainer.assemble_trainer` builds the optimizer, shardings and step
without deciding or re-reading anything. Nothing here allocates on devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from titan_jax.config import JobConfig
from titan_jax.models import BuildOptions, ModelArgs, ModelDef, ModelSpec
from titan_jax.models.lora import NO_LORA, Lora
from titan_jax.models.quantization import Quantization
from titan_jax.models.remat import offload_layer_input_for, remat_mode_for
from titan_jax.models.sharding_hooks import PipelineSplit
from titan_jax.parallel.mesh import MeshDegrees, build_mesh, resolve_degrees
from titan_jax.parallel.rules import ShardingRules, table_for_vocab, table_with_overrides
from titan_jax.parallel.simple_fsdp import SimpleFSDP, choose_implementation
from titan_jax.train import plan_decisions, run_checks
from titan_jax.train.pipeline_plan import plan_pipeline


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The run's decisions, and every number derived from them, read from here by the trainer,
    the loop and the tools. `config` stays the run's input: the sections the plan derives
    nothing from (optimizer, checkpoints, metrics, data) are read there by their owners."""

    config: JobConfig
    model_spec: ModelSpec  # the family (`model.name`)
    degrees: MeshDegrees
    mesh: Mesh  # over the run's devices, possibly abstract (AOT compiles)
    n_microbatches: int  # per optimizer step
    fsdp: type[SimpleFSDP]  # SimpleFSDP's implementation, chosen once
    param_dtype: jnp.dtype  # the compute dtype weights are gathered in
    reduce_dtype: jnp.dtype  # gradients are reduced across data-parallel ranks in it
    attention: str  # the kernel `model.attention` resolved to for the devices
    cp_method: str  # how context parallelism's ranks share K/V (allgather or ring)
    ep_chunks: int  # expert parallelism's exchanges per microbatch (each kernel runs one)
    model: ModelDef  # built for the devices, dtypes, attention and low precision decided;
    # abstract until `init`
    rules: ShardingRules
    param_specs: Any  # every param's storage layout
    buffer_specs: Any
    pipeline: PipelineSplit = PipelineSplit()  # the layers' stages (none: degree 1)

    @property
    def local_batch_size(self) -> int:
        """Rows of one microbatch on one data-parallel rank."""
        return self.config.training.local_batch_size

    @property
    def seq_len(self) -> int:
        return self.config.training.seq_len

    @property
    def global_batch_size(self) -> int:
        """Rows of one optimizer step: `n_microbatches` passes over every data-parallel rank."""
        return self.n_microbatches * self.local_batch_size * self.degrees.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def travelling_tokens(self) -> int:
        """The tokens of one microbatch over the shards that split the vocabulary."""
        return plan_decisions.travelling_tokens(self.config.training, self.degrees)

    @property
    def expert_rows_per_device(self) -> int | None:
        """Rows a device's expert kernels take from one microbatch at balanced routing (all
        `ep_chunks` exchanges together); None for a dense model."""
        args = self.model.args
        if not args.num_experts:
            return None
        return plan_decisions.expert_rows(
            self.local_batch_size, self.seq_len, self.degrees.cp, args
        )

    @property
    def expert_rows_per_step(self) -> int | None:
        """Rows the expert kernels of one whole step take (every microbatch's tokens on every
        data-parallel rank x `top_k`); None for a dense model."""
        args = self.model.args
        if not args.num_experts:
            return None
        return self.tokens_per_step * args.top_k

    def flops_per_token(self) -> float:
        """Training FLOPs per token at the run's sequence length (the MFU numerator)."""
        return self.model_spec.flops_per_token(
            self.model.args, self.seq_len, self.model.options.lora
        )


def resolve_param_dtype(name: str, devices: list[jax.Device]) -> jnp.dtype:
    """`auto` follows the devices the mesh is built on, not the host: bf16 on TPU/GPU (also
    when compiling ahead of time for them from a CPU host), fp32 on CPU (no bf16 matmuls)."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if all(d.platform == "cpu" for d in devices) else jnp.bfloat16)
    return jnp.dtype(name)


def build_options(
    config: JobConfig,
    platform: str,
    attention: str,
    quantization: Quantization,
    lora: Lora = NO_LORA,
) -> BuildOptions:
    """How the model is built for this run's devices and parallelism."""
    reshard = config.parallelism.fsdp_reshard_after_forward in ("default", "always")
    return BuildOptions(
        remat_mode=remat_mode_for(config.activation_checkpoint.mode, platform),
        # Saved only when asked: on one weight shard the "gathered" weight is a copy of the
        # stored one, which backward remakes for free (saved, it is a second copy of every
        # weight, stacked over layers).
        save_gathered_params=not reshard,
        activation_stats=config.metrics.log_activation_stats,
        platform=platform,
        attention=attention,
        lookahead_gather=config.parallelism.fsdp_lookahead_gather,
        expert_gather_before_router=config.parallelism.fsdp_expert_gather_before_router,
        quantization=quantization,
        offload_layer_input=offload_layer_input_for(
            config.activation_checkpoint.offload_layer_input, platform
        ),
        lora=lora,
    )


def plan_run(
    config: JobConfig, devices: list[jax.Device] | None = None, model_args: ModelArgs | None = None
) -> RunPlan:
    """The run's plan on `devices` (default: all of JAX's), every decision checked as it is
    made. `model_args` replaces `model.flavor`'s shape (tests and notebooks use tiny models)."""
    spec, flavor = plan_decisions.model_choice(config)
    args = spec.configure(
        flavor if model_args is None else model_args, plan_decisions.args_overrides(config)
    )
    run_checks.check_model_fits(config, args)
    devices = jax.devices() if devices is None else devices
    degrees = resolve_degrees(config.parallelism, len(devices))
    mesh = build_mesh(degrees, devices, config.parallelism.num_slices)
    run_checks.check_sharding_rules(config, mesh)
    recipe_table = table_with_overrides(config.parallelism.sharding_rules)
    run_checks.check_heads(config, args, degrees, recipe_table)
    run_checks.check_expert_chunks(config, args, degrees)
    pipeline = plan_pipeline(config, args, degrees)
    n_microbatches = plan_decisions.microbatches(config, degrees)
    platform = devices[0].platform
    quantization = plan_decisions.resolve_quantization(config, args, degrees, devices)
    fsdp = choose_implementation(
        config.parallelism, degrees, args, config.model.flavor, platform, quantization
    )
    run_checks.check_reduce_dtype(config, devices, fsdp)
    param_dtype = resolve_param_dtype(config.training.mixed_precision_param, devices)
    attention = plan_decisions.resolve_run_attention(config, degrees.cp, platform, param_dtype)
    cp_method = config.parallelism.context_parallel_method
    run_checks.check_context_parallel(
        degrees.cp,
        plan_decisions.run_seq_lens(config),
        config.model.attention,
        attention,
        cp_method,
    )
    run_checks.check_lookahead_gather(config, fsdp, attention)
    run_checks.check_one_f_one_b(config, degrees, fsdp)
    run_checks.check_pipeline_kernels(config, degrees, fsdp, attention, args, platform)
    run_checks.check_layer_input_offload(config)
    lora = plan_decisions.resolve_lora(config, args, param_dtype)
    model = spec.build(args, build_options(config, platform, attention, quantization, lora))
    table = table_for_vocab(
        mesh,
        args.vocab_size,
        fsdp.splits_vocab_across_replicas,
        table=recipe_table,
        travelling_tokens=plan_decisions.travelling_tokens(config.training, degrees),
    )
    rules = ShardingRules(mesh, table)
    run_checks.check_base_blocks(config, rules, model)
    param_specs, buffer_specs = plan_decisions.storage_specs(config, rules, model)
    return RunPlan(
        config,
        spec,
        degrees,
        mesh,
        n_microbatches,
        fsdp,
        param_dtype,
        jnp.dtype(config.training.mixed_precision_reduce),
        attention,
        cp_method,
        config.parallelism.expert_parallel_chunks,
        model,
        rules,
        param_specs,
        buffer_specs,
        pipeline,
    )
