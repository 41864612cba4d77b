"""The trainer: a run's plan (`run_plan.plan_run`) assembled into its optimizer, train-state and
batch shardings, SimpleFSDP and the compiled step. Assembling decides nothing: every choice
and check is the plan's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding

from titan_jax.config import JobConfig
from titan_jax.models.spec import ModelArgs
from titan_jax.parallel.batch_placement import BatchPlacement
from titan_jax.parallel.simple_fsdp import SimpleFSDP
from titan_jax.parallel.state_shardings import batch_sharding, train_state_shardings
from titan_jax.train.objective import objective_for
from titan_jax.train.optim import WSDSchedule, build_optimizer
from titan_jax.train.run_plan import RunPlan, plan_run
from titan_jax.train.step import (
    APPLIED_UPDATES,
    REFERENCE,
    Batch,
    StepOptions,
    TrainState,
    init_train_state,
    train_step,
)
from titan_jax.trees import merge_nested, named_leaves, split_by_name


@dataclasses.dataclass
class Trainer:
    plan: RunPlan
    schedule: WSDSchedule
    optimizer: optax.GradientTransformationExtraArgs
    options: StepOptions
    state_shardings: Any
    batches: BatchPlacement  # which rows each process reads, and how they become global arrays
    parallelism: SimpleFSDP  # the model's hooks and the loss map: gather at use, fp32 reduce

    @property
    def keeps_reference(self) -> bool:
        """The state holds a frozen copy of the initial params (DPO's reference model)."""
        return self.options.objective.keeps_reference

    def init_state(self, seed: int | None = None) -> TrainState:
        """Sharded random init: each device computes only its own shards."""
        key = jax.random.key(self.plan.config.training.seed if seed is None else seed)

        def init(key: jax.Array) -> TrainState:
            return init_train_state(
                self.plan.model.init(key),
                self.plan.model.init_buffers(),
                self.optimizer,
                self.plan.model.trainable,
                self.keeps_reference,
            )

        with jax.set_mesh(self.plan.mesh):
            return jax.jit(init, out_shardings=self.state_shardings)(key)

    def state_from_params(self, params: Any) -> TrainState:
        """A fresh train state (new optimizer and buffers, step 0) around loaded params. A
        base model's weights (`plain_base`: fp32, no LoRA adapters) get fresh adapters, whose
        B is zero (the model starts as the base), and are stored as `lora.base_dtype` says
        (cast, or quantized). DPO's reference (without LoRA) is these params."""
        trainable = self.plan.model.trainable
        fresh_adapters = trainable is not None and not trainable & set(named_leaves(params))
        key = jax.random.key(self.plan.config.training.seed)

        def state(params: Any, key: jax.Array) -> TrainState:
            if fresh_adapters:  # the rest of this init is dead code to XLA
                adapters = split_by_name(self.plan.model.init(key), trainable)[0]
                params = self.plan.model.stored(merge_nested(params, adapters))
            return init_train_state(
                params,
                self.plan.model.init_buffers(),
                self.optimizer,
                trainable,
                self.keeps_reference,
            )

        with jax.set_mesh(self.plan.mesh):
            return jax.jit(state, out_shardings=self.state_shardings)(params, key)

    def base_params(self, tree: Any) -> Any:
        """A params-shaped `tree` without the LoRA adapters: the part a base model fills."""
        trainable = self.plan.model.trainable
        return tree if trainable is None else split_by_name(tree, trainable)[1]

    def plain_base(self) -> Any:
        """The base model's params as a checkpoint of it holds them (fp32, before a LoRA
        base is narrowed), abstract, with their shardings: what base loads fill."""
        model = self.plan.model
        specs = self.plan.rules.storage_specs(model.plain_params, model.plain_logical_axes)
        return self.base_params(
            jax.tree.map(
                lambda s, spec: jax.ShapeDtypeStruct(
                    s.shape, s.dtype, sharding=NamedSharding(self.plan.mesh, spec)
                ),
                model.plain_params,
                specs,
            )
        )

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the train state, without allocating it."""
        shapes = jax.eval_shape(
            lambda: init_train_state(
                self.plan.model.abstract_params,
                self.plan.model.abstract_buffers,
                self.optimizer,
                self.plan.model.trainable,
                self.keeps_reference,
            )
        )
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self.state_shardings,
        )

    @functools.cached_property
    def _jitted_step(self) -> Any:
        step = functools.partial(
            train_step,
            model=self.plan.model,
            optimizer=self.optimizer,
            schedule=self.schedule,
            options=self.options,
            parallelism=self.parallelism,
        )
        return jax.jit(
            step,
            donate_argnums=0,
            in_shardings=(self.state_shardings, self.batches.sharding),
            out_shardings=(self.state_shardings, None),
        )

    def step_fn(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """The jitted whole step; the input state's buffers are donated to the output."""
        with jax.set_mesh(self.plan.mesh):
            return self._jitted_step(state, batch)

    def lower_step(self, state: Any, batch: Any) -> Any:
        """The step lowered for (possibly abstract) inputs, for inspection and AOT compiles."""
        with jax.set_mesh(self.plan.mesh):
            return self._jitted_step.lower(state, batch)


def assemble_trainer(plan: RunPlan) -> Trainer:
    """The optimizer, shardings, SimpleFSDP and step of a planned run (nothing allocated)."""
    config, t = plan.config, plan.config.training  # the sections the plan derives nothing from
    optimizer = build_optimizer(config.optimizer)
    objective = objective_for(config.dpo, lora=plan.model.trainable is not None)
    state_shardings = train_state_shardings(
        plan.rules,
        plan.param_specs,
        plan.buffer_specs,
        optimizer,
        plan.model.abstract_params,
        ("step", APPLIED_UPDATES),
        plan.model.trainable,
    )
    if objective.keeps_reference:  # sharded like the params it copies
        state_shardings[REFERENCE] = state_shardings["params"]
    parallelism = plan.fsdp(
        plan.rules,
        plan.param_specs,
        plan.buffer_specs,
        reduce_dtype=plan.reduce_dtype,
        cp_method=plan.cp_method,
        ep_chunks=plan.ep_chunks,
        param_axes=plan.model.logical_axes,
        pipeline=plan.pipeline,
    )
    return Trainer(
        plan,
        WSDSchedule.from_config(config.optimizer.lr, config.lr_scheduler, t.steps),
        optimizer,
        StepOptions(
            n_microbatches=plan.n_microbatches,
            param_dtype=plan.param_dtype,
            max_norm=t.max_norm,
            objective=objective,
            dropout_seed=t.seed if plan.model.options.lora.dropout else None,
        ),
        state_shardings,
        BatchPlacement(batch_sharding(plan.rules), plan.global_batch_size, plan.degrees.cp),
        parallelism,
    )


def build_trainer(
    config: JobConfig, devices: list[jax.Device] | None = None, model_args: ModelArgs | None = None
) -> Trainer:
    """The trainer of `config` on `devices` (`run_plan.plan_run`: every decision checked as it
    is made); nothing allocated on devices."""
    return assemble_trainer(plan_run(config, devices, model_args))
