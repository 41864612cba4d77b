"""Everything a run needs before its first step, derived once from the config.

config -> mesh -> model definition + rules -> shardings -> sharded init and the compiled step.
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

from titan_jax.config import ConfigError, JobConfig
from titan_jax.models.qwen3 import ModelDef, Qwen3Args, RematPolicy, build_model_def, get_flavor
from titan_jax.models.qwen3.build import path_name
from titan_jax.parallel.mesh import BATCH_AXES, MeshDegrees, build_mesh, resolve_degrees
from titan_jax.parallel.rules import logical_to_spec
from titan_jax.parallel.simple_fsdp import SimpleFSDP
from titan_jax.train.optim import WSDSchedule, build_optimizer
from titan_jax.train.step import Batch, StepOptions, TrainState, init_train_state, train_step


def resolve_param_dtype(name: str) -> jnp.dtype:
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(name)


def param_specs(model: ModelDef, mesh: Mesh) -> Any:
    """PartitionSpec of every stored parameter, from its logical axes and the rules table."""
    axes = model.logical_axes
    return jax.tree_util.tree_map_with_path(
        lambda path, sds: logical_to_spec(
            path_name(path), _lookup(axes, path), sds.shape, mesh), model.abstract_params)


def _lookup(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key.key]
    return tree


@dataclasses.dataclass
class Trainer:
    config: JobConfig
    mesh: Mesh
    degrees: MeshDegrees
    model: ModelDef
    schedule: WSDSchedule
    optimizer: optax.GradientTransformation
    options: StepOptions
    state_shardings: Any
    batch_sharding: NamedSharding
    fsdp: SimpleFSDP  # how weights are gathered at use and their gradients reduced

    @property
    def global_batch_size(self) -> int:
        return self.options.n_microbatches * self.config.training.local_batch_size * self.degrees.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.config.training.seq_len

    def init_state(self, seed: int | None = None) -> TrainState:
        """Sharded random init: each device computes only its own shards."""
        key = jax.random.key(self.config.training.seed if seed is None else seed)

        def init(key: jax.Array) -> TrainState:
            return init_train_state(self.model.init(key), self.optimizer)

        with jax.set_mesh(self.mesh):
            return jax.jit(init, out_shardings=self.state_shardings)(key)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the train state, without allocating it."""
        shapes = jax.eval_shape(
            lambda: init_train_state(self.model.abstract_params, self.optimizer)
        )
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    @functools.cached_property
    def _jitted_step(self) -> Any:
        step = functools.partial(train_step, model=self.model, optimizer=self.optimizer,
                                 schedule=self.schedule, options=self.options,
                                 param_use=self.fsdp.param_use, loss_map=self.fsdp.loss_map)
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

    def put_batch(self, local: dict[str, np.ndarray]) -> Batch:
        """This process's rows -> global arrays sharded over the data-parallel axes."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v)
                for k, v in local.items()}


def build_trainer(config: JobConfig, devices: list[jax.Device] | None = None,
                  model_args: Qwen3Args | None = None) -> Trainer:
    """`model_args` replaces `model.flavor`'s shape (tests and notebooks use tiny models)."""
    t = config.training
    args = get_flavor(config.model.flavor) if model_args is None else model_args
    if t.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len={t.seq_len} exceeds the maximum sequence length "
            f"{args.max_seq_len} of model.flavor={config.model.flavor}"
        )
    devices = jax.devices() if devices is None else devices
    degrees = resolve_degrees(config.parallelism, len(devices))
    mesh = build_mesh(degrees, devices)
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

    reshard = config.parallelism.fsdp_reshard_after_forward in ("default", "always")
    remat = RematPolicy(config.activation_checkpoint.mode,
                        save_gathered_params=not (reshard and degrees.fsdp > 1))
    model = build_model_def(args, remat)
    try:
        specs = param_specs(model, mesh)
    except ValueError as e:
        raise ConfigError(f"cannot shard model.flavor={config.model.flavor} on this mesh: {e}"
                          ) from None
    schedule = WSDSchedule.from_config(config.optimizer.lr, config.lr_scheduler, t.steps)
    optimizer = build_optimizer(config.optimizer, schedule)
    options = StepOptions(n_microbatches=global_batch // per_step,
                          param_dtype=resolve_param_dtype(t.mixed_precision_param),
                          max_norm=t.max_norm)

    # Optimizer moments inherit their parameter's sharding; scalars are replicated.
    param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    abstract_opt = jax.eval_shape(optimizer.init, model.abstract_params)
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, abstract_opt, param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()),
    )
    state_shardings = {"params": param_shardings, "opt_state": opt_shardings,
                       "step": NamedSharding(mesh, PartitionSpec())}
    batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    fsdp = SimpleFSDP(mesh, specs, config.parallelism.fsdp_implementation)
    return Trainer(config, mesh, degrees, model, schedule, optimizer, options, state_shardings,
                   batch_sharding, fsdp)
