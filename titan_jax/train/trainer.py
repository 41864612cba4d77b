"""Everything a run needs before its first step, derived once from the config.

config -> mesh -> model (from the registry) + the rules table -> shardings -> sharded init and
the compiled step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from titan_jax.config import ConfigError, JobConfig, Moe
from titan_jax.models import BuildOptions, ModelDef, ModelSpec, get_model_spec
from titan_jax.models.attention import CP_ATTENTION, SPLASH_BLOCKS, resolve_attention
from titan_jax.models.remat import remat_mode_for
from titan_jax.parallel.context_parallel import check_seq_len, to_load_balanced
from titan_jax.parallel.mesh import MeshDegrees, build_mesh, resolve_degrees
from titan_jax.parallel.rules import ShardingRuleError, ShardingRules, table_for_vocab
from titan_jax.parallel.simple_fsdp import SimpleFSDP
from titan_jax.train.optim import WSDSchedule, build_optimizer
from titan_jax.train.step import (
    APPLIED_UPDATES,
    Batch,
    StepOptions,
    TrainState,
    init_train_state,
    train_step,
)


def check_moe_knobs(config: JobConfig, args: Any) -> None:
    """`[moe]` keys set on a dense flavour are refused, as an expert degree is: nothing reads
    them there."""
    if getattr(args, "is_moe", False):
        return
    changed = [f"moe.{f.name}={getattr(config.moe, f.name)}" for f in dataclasses.fields(Moe)
               if getattr(config.moe, f.name) != f.default]
    if changed:
        raise ConfigError(f"{changed[0]} applies to MoE flavours only; model.flavor="
                          f"{config.model.flavor} is dense (leave [moe] out)")


def resolve_implementation(config: JobConfig, degrees: MeshDegrees, args: Any,
                           platform: str = "cpu") -> str:
    """SimpleFSDP's implementation, with the checks expert parallelism needs. MoE on TPU/GPU
    takes shard_map: the jit path maps the loss over data shards with vmap, which makes the
    experts' `ragged_dot` a batched op that XLA:TPU rejects ("number of batch dimensions
    should be 0"); inside shard_map it stays unbatched."""
    p = config.parallelism
    if degrees.cp > 1 and p.fsdp_implementation == "jit":
        raise ConfigError(
            "parallelism.fsdp_implementation=jit cannot host context parallelism (its K/V "
            "gathers run over the manual cp axis of the shard_map implementation); use auto or "
            "shard_map")
    ragged = getattr(args, "is_moe", False) and platform != "cpu"  # CPU: blocked einsums
    if ragged and degrees.ep == 1:
        if p.fsdp_implementation == "jit":
            raise ConfigError(
                f"parallelism.fsdp_implementation=jit cannot compile MoE experts for {platform} "
                "(ragged_dot under the jit path's per-shard vmap); use auto or shard_map")
        return "shard_map"
    if degrees.ep > 1:
        if not getattr(args, "is_moe", False):
            raise ConfigError(
                f"parallelism.expert_parallel_degree={degrees.ep} applies to MoE flavours only; "
                f"model.flavor={config.model.flavor} is dense (use 1)")
        if args.num_experts % degrees.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree={degrees.ep} must divide the "
                f"{args.num_experts} experts of model.flavor={config.model.flavor}")
        if p.fsdp_implementation == "jit":
            raise ConfigError(
                "parallelism.fsdp_implementation=jit cannot host expert parallelism (its token "
                "all-to-alls need the shard_map implementation); use auto or shard_map")
        return "shard_map"
    if p.fsdp_implementation == "auto":
        return "shard_map" if degrees.cp > 1 else "jit"
    return p.fsdp_implementation


def check_context_parallel(cp: int, seq_lens: dict[str, int], choice: str,
                           attention: str) -> None:
    """Sequences cp can split, and an attention kernel that takes the split."""
    for field, n in seq_lens.items():
        check_seq_len(n, cp, field)
        if cp > 1 and attention == "splash" and (n // (2 * cp)) % SPLASH_BLOCKS[-1]:
            raise ConfigError(
                f"{field}={n} must be a multiple of 2 x parallelism.context_parallel_degree x "
                f"{SPLASH_BLOCKS[-1]} = {2 * cp * SPLASH_BLOCKS[-1]} for model.attention="
                f"splash (each rank's two chunks are tiled by its blocks); or use "
                "model.attention=xla")
    if cp > 1 and attention not in CP_ATTENTION:
        raise ConfigError(
            f"model.attention={choice} (resolved: {attention}) cannot run with parallelism."
            f"context_parallel_degree={cp}; use {' or '.join(CP_ATTENTION)}")


def resolve_param_dtype(name: str, devices: list[jax.Device]) -> jnp.dtype:
    """`auto` follows the devices the mesh is built on, not the host: bf16 on TPU/GPU (also
    when compiling ahead of time for them from a CPU host), fp32 on CPU (no bf16 matmuls)."""
    if name == "auto":
        return jnp.float32 if all(d.platform == "cpu" for d in devices) else jnp.bfloat16
    return jnp.dtype(name)


@dataclasses.dataclass
class Trainer:
    config: JobConfig
    mesh: Mesh
    degrees: MeshDegrees
    model_spec: ModelSpec
    model: ModelDef
    rules: ShardingRules
    schedule: WSDSchedule
    optimizer: optax.GradientTransformationExtraArgs
    options: StepOptions
    state_shardings: Any
    batch_sharding: NamedSharding
    parallelism: SimpleFSDP  # the model's hooks and the loss map: gather at use, fp32 reduce
    attention: str  # the attention kernel `model.attention` resolved to for the devices

    @property
    def global_batch_size(self) -> int:
        return self.options.n_microbatches * self.config.training.local_batch_size * self.degrees.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.config.training.seq_len

    def flops_per_token(self) -> float:
        return self.model_spec.flops_per_token(self.model.args, self.config.training.seq_len)

    def init_state(self, seed: int | None = None) -> TrainState:
        """Sharded random init: each device computes only its own shards."""
        key = jax.random.key(self.config.training.seed if seed is None else seed)

        def init(key: jax.Array) -> TrainState:
            return init_train_state(self.model.init(key), self.model.init_buffers(),
                                    self.optimizer)

        with jax.set_mesh(self.mesh):
            return jax.jit(init, out_shardings=self.state_shardings)(key)

    def state_from_params(self, params: Any) -> TrainState:
        """A fresh train state (new optimizer and buffers, step 0) around loaded params."""
        with jax.set_mesh(self.mesh):
            return jax.jit(lambda p: init_train_state(p, self.model.init_buffers(),
                                                      self.optimizer),
                           out_shardings=self.state_shardings)(params)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the train state, without allocating it."""
        shapes = jax.eval_shape(lambda: init_train_state(
            self.model.abstract_params, self.model.abstract_buffers, self.optimizer))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    @functools.cached_property
    def _jitted_step(self) -> Any:
        step = functools.partial(train_step, model=self.model, optimizer=self.optimizer,
                                 schedule=self.schedule, options=self.options,
                                 parallelism=self.parallelism)
        return jax.jit(step, donate_argnums=0,
                       in_shardings=(self.state_shardings, self.batch_sharding),
                       out_shardings=(self.state_shardings, None))

    def step_fn(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """The jitted whole step; the input state's buffers are donated to the output."""
        with jax.set_mesh(self.mesh):
            return self._jitted_step(state, batch)

    def lower_step(self, state: Any, batch: Any) -> Any:
        """The step lowered for (possibly abstract) inputs, for inspection and AOT compiles."""
        with jax.set_mesh(self.mesh):
            return self._jitted_step.lower(state, batch)

    def batch_rows(self, global_batch_size: int | None = None) -> list[int]:
        """The rows of a global batch that this process's devices hold, ascending: read off the
        batch sharding, not the process index (with tensor parallelism across hosts, several
        processes hold the same rows)."""
        n = self.global_batch_size if global_batch_size is None else global_batch_size
        return held_rows(self.batch_sharding, n, self.mesh.local_devices)

    def put_batch(self, local: dict[str, np.ndarray],
                  global_batch_size: int | None = None) -> Batch:
        """This process's `batch_rows` -> global arrays sharded over the data-parallel axes.
        Under context parallelism each row is laid out in load-balanced order and only the
        chunks this process's devices hold are put on them."""
        n = self.global_batch_size if global_batch_size is None else global_batch_size
        out = {}
        for k, v in local.items():
            v = to_load_balanced(v, self.degrees.cp)
            held = held_seq(self.batch_sharding, (n, v.shape[1]), self.mesh.local_devices)
            out[k] = jax.make_array_from_process_local_data(self.batch_sharding, v[:, held],
                                                            (n, *v.shape[1:]))
        return out


def held_rows(sharding: NamedSharding, n_rows: int, devices: list[jax.Device]) -> list[int]:
    """Rows of an (n_rows, ...) array sharded by `sharding` that `devices` hold, ascending."""
    # Any seq length the sharding divides (context parallelism splits dim 1 too).
    index = sharding.devices_indices_map((n_rows, sharding.mesh.size))
    return sorted({r for d in devices for r in range(n_rows)[index[d][0]]})


def held_seq(sharding: NamedSharding, shape: tuple[int, int], devices: list[jax.Device]
             ) -> slice:
    """The span of sequence positions (in load-balanced layout order) that `devices` hold."""
    index = sharding.devices_indices_map(shape)
    spans = [range(shape[1])[index[d][1]] for d in devices]
    return slice(min(r.start for r in spans), max(r.stop for r in spans))


def build_trainer(config: JobConfig, devices: list[jax.Device] | None = None,
                  model_args: Any = None) -> Trainer:
    """`model_args` replaces `model.flavor`'s shape (tests and notebooks use tiny models)."""
    t = config.training
    spec = get_model_spec(config.model.name)
    args = spec.configure(spec.flavor(config.model.flavor) if model_args is None else model_args,
                          config)
    check_moe_knobs(config, args)
    if t.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len={t.seq_len} exceeds the maximum sequence length "
            f"{args.max_seq_len} of model.flavor={config.model.flavor}"
        )
    devices = jax.devices() if devices is None else devices
    degrees = resolve_degrees(config.parallelism, len(devices))
    mesh = build_mesh(degrees, devices, config.parallelism.num_slices)
    if args.n_heads % degrees.tp or args.n_kv_heads % degrees.tp:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={degrees.tp} must divide n_heads={args.n_heads} "
            f"and n_kv_heads={args.n_kv_heads} of model.flavor={config.model.flavor}"
        )

    per_step = t.local_batch_size * degrees.dp
    global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_step:
        raise ConfigError(
            f"training.global_batch_size={global_batch} must be a multiple of "
            f"local_batch_size x data-parallel degree = {t.local_batch_size} x {degrees.dp}"
        )

    implementation = resolve_implementation(config, degrees, args, devices[0].platform)
    if (t.mixed_precision_reduce == "bfloat16" and all(d.platform == "cpu" for d in devices)
            and implementation == "shard_map"):
        raise ConfigError(  # XLA:CPU aborts on a bf16 reduce-scatter ("opcode copy")
            "training.mixed_precision_reduce=bfloat16 with parallelism.fsdp_implementation="
            "shard_map does not compile on CPU devices; use float32, or the jit implementation")
    reshard = config.parallelism.fsdp_reshard_after_forward in ("default", "always")
    param_dtype = resolve_param_dtype(t.mixed_precision_param, devices)
    platform = devices[0].platform
    seq_lens = {"training.seq_len": t.seq_len}
    if config.validation.enable:
        seq_lens["validation.seq_len"] = config.validation.seq_len
    attention = resolve_attention(config.model.attention, platform, param_dtype, seq_lens)
    check_context_parallel(degrees.cp, seq_lens, config.model.attention, attention)
    model = spec.build(args, BuildOptions(
        remat_mode=remat_mode_for(config.activation_checkpoint.mode, platform),
        save_gathered_params=not (reshard and degrees.weight_shard > 1),
        activation_stats=config.metrics.log_activation_stats, platform=platform,
        attention=attention))
    rules = ShardingRules(mesh, table_for_vocab(mesh, args.vocab_size))
    try:  # every array's storage layout, checked against its shape and named on error
        param_specs = rules.storage_specs(model.abstract_params, model.logical_axes)
        buffer_specs = rules.storage_specs(model.abstract_buffers, model.buffer_logical_axes)
    except ShardingRuleError as e:
        raise ConfigError(f"cannot shard model.flavor={config.model.flavor} on this mesh: {e}"
                          ) from None
    schedule = WSDSchedule.from_config(config.optimizer.lr, config.lr_scheduler, t.steps)
    optimizer = build_optimizer(config.optimizer)
    options = StepOptions(n_microbatches=global_batch // per_step,
                          param_dtype=param_dtype,
                          max_norm=t.max_norm)

    # Optimizer moments inherit their parameter's sharding; scalars are replicated.
    named = lambda specs: jax.tree.map(  # noqa: E731
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    param_shardings = named(param_specs)
    abstract_opt = jax.eval_shape(optimizer.init, model.abstract_params)
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, abstract_opt, param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()),
    )
    scalar = NamedSharding(mesh, PartitionSpec())
    state_shardings = {"params": param_shardings, "buffers": named(buffer_specs),
                       "opt_state": opt_shardings, "step": scalar, APPLIED_UPDATES: scalar}
    batch_sharding = NamedSharding(mesh, rules.batch_spec)
    parallelism = SimpleFSDP(rules, param_specs, buffer_specs, implementation,
                             jnp.dtype(t.mixed_precision_reduce), model.logical_axes)
    return Trainer(config, mesh, degrees, spec, model, rules, schedule, optimizer, options,
                   state_shardings, batch_sharding, parallelism, attention)
