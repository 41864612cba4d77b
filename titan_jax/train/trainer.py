"""Everything a run needs before its first step, derived once from the config.

config -> mesh -> model (from the registry) + the rules table -> shardings (`parallel/`) ->
sharded init and the compiled step; every check on the way is `run_checks`'.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from titan_jax.config import JobConfig
from titan_jax.models import BuildOptions, ModelDef, ModelSpec
from titan_jax.models.quantization import Quantization
from titan_jax.models.remat import remat_mode_for
from titan_jax.parallel.context_parallel import held_spans, to_load_balanced
from titan_jax.parallel.mesh import MeshDegrees, build_mesh, resolve_degrees
from titan_jax.parallel.rules import ShardingRules, table_for_vocab
from titan_jax.parallel.simple_fsdp import SimpleFSDP, simple_fsdp
from titan_jax.parallel.state_shardings import batch_sharding, train_state_shardings
from titan_jax.train import run_checks
from titan_jax.train.optim import WSDSchedule, build_optimizer
from titan_jax.train.step import (
    APPLIED_UPDATES,
    Batch,
    StepOptions,
    TrainState,
    init_train_state,
    train_step,
)


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

    def batch_spans(self, seq_len: int, devices: list[jax.Device] | None = None
                    ) -> list[tuple[int, int]] | None:
        """The token ranges of each row (in the load-balanced layout's order) that
        `devices` (default: this process's) hold under context parallelism; None: all."""
        devices = self.mesh.local_devices if devices is None else devices
        held = held_seq(self.batch_sharding, (self.global_batch_size, seq_len), devices)
        if held == slice(0, seq_len):
            return None
        return held_spans(held, seq_len, self.degrees.cp)

    def put_batch(self, local: dict[str, np.ndarray], global_batch_size: int | None = None,
                  seq_len: int | None = None) -> Batch:
        """This process's `batch_rows` -> global arrays sharded over the data-parallel axes.
        Under context parallelism each row is laid out in load-balanced order and only the
        chunks this process's devices hold are put on them. `seq_len`: the rows' whole
        length when `local` holds only this process's chunks (`batch_spans`, in that order)."""
        n = self.global_batch_size if global_batch_size is None else global_batch_size
        out = {}
        for k, v in local.items():
            whole = v.shape[1] if seq_len is None else seq_len
            if v.shape[1] == whole:
                v = to_load_balanced(v, self.degrees.cp)
                v = v[:, held_seq(self.batch_sharding, (n, whole), self.mesh.local_devices)]
            out[k] = jax.make_array_from_process_local_data(self.batch_sharding, v,
                                                            (n, whole, *v.shape[2:]))
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


def _build_options(config: JobConfig, platform: str, attention: str,
                   quantization: Quantization) -> BuildOptions:
    reshard = config.parallelism.fsdp_reshard_after_forward in ("default", "always")
    return BuildOptions(
        remat_mode=remat_mode_for(config.activation_checkpoint.mode, platform),
        # Saved only when asked: on one weight shard the "gathered" weight is a copy of the
        # stored one, which backward remakes for free (saved, it is a second copy of every
        # weight, stacked over layers).
        save_gathered_params=not reshard,
        activation_stats=config.metrics.log_activation_stats, platform=platform,
        attention=attention, lookahead_gather=config.parallelism.fsdp_lookahead_gather,
        quantization=quantization)


def build_trainer(config: JobConfig, devices: list[jax.Device] | None = None,
                  model_args: Any = None) -> Trainer:
    """Mesh, model, shardings, optimizer and step of a run, each checked as it is derived
    (`run_checks`); nothing allocated on devices. `model_args` replaces `model.flavor`'s shape
    (tests and notebooks use tiny models)."""
    t = config.training
    spec, flavor = run_checks.check_model_choice(config)
    args = spec.configure(flavor if model_args is None else model_args, config)
    run_checks.check_model_fits(config, args)
    devices = jax.devices() if devices is None else devices
    degrees = resolve_degrees(config.parallelism, len(devices))
    mesh = build_mesh(degrees, devices, config.parallelism.num_slices)
    run_checks.check_heads(config, args, degrees)
    n_microbatches = run_checks.microbatches(config, degrees)
    platform = devices[0].platform
    quantization = run_checks.resolve_quantization(config, args, degrees, devices)
    implementation = run_checks.resolve_implementation(config, degrees, args, platform,
                                                       quantization)
    run_checks.check_reduce_dtype(config, devices, implementation)
    param_dtype = resolve_param_dtype(t.mixed_precision_param, devices)
    attention = run_checks.resolve_run_attention(config, degrees.cp, platform, param_dtype)
    run_checks.check_lookahead_gather(config, args, implementation, attention)
    model = spec.build(args, _build_options(config, platform, attention, quantization))
    rules = ShardingRules(mesh, table_for_vocab(mesh, args.vocab_size, implementation))
    param_specs, buffer_specs = run_checks.storage_specs(config, rules, model)
    optimizer = build_optimizer(config.optimizer)
    state_shardings = train_state_shardings(rules, param_specs, buffer_specs, optimizer,
                                            model.abstract_params, ("step", APPLIED_UPDATES))
    parallelism = simple_fsdp(implementation, rules, param_specs, buffer_specs,
                              reduce_dtype=jnp.dtype(t.mixed_precision_reduce),
                              cp_method=config.parallelism.context_parallel_method,
                              param_axes=model.logical_axes)
    return Trainer(
        config, mesh, degrees, spec, model, rules,
        WSDSchedule.from_config(config.optimizer.lr, config.lr_scheduler, t.steps), optimizer,
        StepOptions(n_microbatches=n_microbatches, param_dtype=param_dtype, max_norm=t.max_norm),
        state_shardings, batch_sharding(rules), parallelism, attention)
