"""A run's pipeline (`parallelism.pipeline_parallel_*`), checked against the model, the batch
and the other settings, as the `PipelineSplit` SimpleFSDP hands the model
(titan_jax/models/pipeline.py). Each refusal is a ConfigError naming the field, its value
and what would be valid."""

from __future__ import annotations

from typing import Any

from titan_jax.config import ConfigError, JobConfig
from titan_jax.models.sharding_hooks import PipelineSplit
from titan_jax.parallel.mesh import MeshDegrees

PP_AXIS = "pp"  # the mesh axis of the stages (parallel/mesh.py)


def plan_pipeline(config: JobConfig, args: Any, degrees: MeshDegrees) -> PipelineSplit:
    """The pipeline of a run (degree 1: none); refuses what cannot be split or hosted."""
    p = config.parallelism
    pp, virtual, schedule = (
        degrees.pp,
        p.pipeline_parallel_virtual_stages,
        p.pipeline_parallel_schedule,
    )
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_virtual_stages={virtual} needs "
            f"pipeline_parallel_schedule=interleaved ({schedule} holds one chunk a stage: set "
            "it to 1)"
        )
    if schedule == "interleaved" and virtual < 2:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule=interleaved needs "
            f"pipeline_parallel_virtual_stages >= 2 (got {virtual}); with one chunk a stage "
            "use gpipe"
        )
    if pp == 1:
        return PipelineSplit()
    chunks = pp * virtual
    if args.n_layers % chunks:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={pp} x pipeline_parallel_virtual_stages="
            f"{virtual} = {chunks} chunks do not divide the model's {args.n_layers} layers; "
            f"use a degree x virtual stages that divides {args.n_layers}"
        )
    m = pp if p.pipeline_parallel_microbatches == -1 else p.pipeline_parallel_microbatches
    if m < pp:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatches={m} is fewer than the "
            f"{pp} stages; use at least {pp} (each stage reads a microbatch's slot after the "
            "last stage has written it)"
        )
    batches = [("training.local_batch_size", config.training.local_batch_size)]
    if config.validation.enable:
        batches.append(("validation.local_batch_size", config.validation.local_batch_size))
    for name, rows in batches:
        if rows % m:
            raise ConfigError(
                f"{name}={rows} does not split into parallelism.pipeline_parallel_microbatches="
                f"{m}; use a multiple of {m}"
            )
    if p.fsdp_lookahead_gather:
        raise ConfigError(
            "parallelism.fsdp_lookahead_gather cannot run under pipeline_parallel_degree="
            f"{pp} (the stages replace the look-ahead layer scan); set it to false"
        )
    if schedule == "1f1b":
        _check_one_f_one_b(config, args)
    return PipelineSplit(pp, virtual, m, PP_AXIS, schedule)


def _check_one_f_one_b(config: JobConfig, args: Any) -> None:
    """1F1B computes each microbatch's cross-entropy inside the pipeline, at its last stage
    (`models/one_f_one_b.py`): a loss of the whole batch cannot be split that way."""
    if config.dpo.enable:
        raise ConfigError(
            "parallelism.pipeline_parallel_schedule=1f1b cannot train dpo.enable=true (its "
            "loss compares whole sequences of two models); use gpipe"
        )
    coef = config.moe.router_aux_loss_coef
    if args.is_moe and coef > 0:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule=1f1b cannot take moe.router_aux_loss_coef="
            f"{coef} (a loss of the whole batch's routing); use gpipe, or set it to 0"
        )
