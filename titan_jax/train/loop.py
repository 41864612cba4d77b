"""The host loop: data -> step -> metrics, one step behind so the host never stalls the device."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from titan_jax.config import ConfigError, JobConfig
from titan_jax.data.dataset import TrainIterator, build_train_iterator
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.train.metrics import (
    MetricsLogger,
    flops_per_token,
    memory_stats,
    peak_flops_per_device,
)
from titan_jax.train.step import TrainState
from titan_jax.train.trainer import Trainer, build_trainer


class BadStepsError(RuntimeError):
    """Too many non-finite steps in a row: the run stops instead of training on garbage."""


@dataclasses.dataclass
class RunResult:
    final_step: int
    losses: dict[int, float]  # every step's loss, by step number
    state: TrainState


def build_data(config: JobConfig, trainer: Trainer) -> TrainIterator:
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    if tokenizer.vocab_size > trainer.model.args.vocab_size:
        raise ConfigError(
            f"tokenizer {config.model.tokenizer_path or '(shipped)'} has vocab size "
            f"{tokenizer.vocab_size}, larger than model.flavor={config.model.flavor}'s "
            f"vocab_size={trainer.model.args.vocab_size}"
        )
    t = config.training
    return build_train_iterator(
        dataset=t.dataset, dataset_path=t.dataset_path, text_field=t.text_field,
        tokenizer=tokenizer, seq_len=t.seq_len, global_batch_size=trainer.global_batch_size,
        seed=t.seed, process_index=jax.process_index(), process_count=jax.process_count(),
    )


class _StepReporter:
    """Turns each step's on-device metrics into logged numbers once they are ready."""

    def __init__(self, config: JobConfig, trainer: Trainer, logger: MetricsLogger):
        self.config, self.trainer, self.logger = config, trainer, logger
        t = config.training
        device = trainer.mesh.devices.flat[0]
        dtype = np.dtype(trainer.options.param_dtype).name
        self.peak, peak_source = peak_flops_per_device(device, dtype)
        self.flops_per_step = flops_per_token(trainer.model.args, t.seq_len) * trainer.tokens_per_step
        self.n_devices = trainer.mesh.devices.size
        self.bad_in_a_row = 0
        self.losses: dict[int, float] = {}
        self.last_ready: float | None = None
        logger.info(f"MFU peak: {self.peak / 1e12:.3f} TFLOP/s per device ({peak_source})")

    def report(self, step: int, metrics: dict[str, jax.Array]) -> None:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time = None if self.last_ready is None else now - self.last_ready
        self.last_ready = now
        self.losses[step] = values["loss"]
        if not values["finite"]:
            self.bad_in_a_row += 1
            self.logger.info(f"step {step}: non-finite loss={values['loss']} or "
                             f"grad_norm={values['grad_norm']}; update skipped "
                             f"({self.bad_in_a_row} in a row)")
            limit = self.config.training.max_consecutive_bad_steps
            if self.bad_in_a_row >= limit:
                raise BadStepsError(
                    f"{self.bad_in_a_row} non-finite steps in a row (training."
                    f"max_consecutive_bad_steps={limit}); stopping at step {step}"
                )
        else:
            self.bad_in_a_row = 0
        if not self.logger.should_log(step):
            self.logger.advance(step)
            return
        # The first step includes compilation, so it has no meaningful throughput.
        tps = self.trainer.tokens_per_step / step_time if step_time else 0.0
        mfu = 100 * self.flops_per_step / step_time / (self.peak * self.n_devices) if step_time \
            else 0.0
        mem = memory_stats()
        self.logger.log(step, {
            "step": step, "loss": values["loss"], "grad_norm": values["grad_norm"],
            "lr": values["lr"], "tokens_per_sec": tps, "mfu_pct": mfu,
            "step_time_s": step_time or 0.0, "n_tokens": values["n_tokens"],
            "memory_peak_gib": mem["peak_bytes"] / 2**30,
        })


def train(config: JobConfig, devices: list[jax.Device] | None = None) -> RunResult:
    """Runs `training.steps` steps of `config` and returns the final state and losses."""
    trainer = build_trainer(config, devices)
    data = build_data(config, trainer)
    dump = Path(config.job.dump_folder)
    m = config.metrics
    logger = MetricsLogger(str(dump), m.log_freq, config.training.steps,
                           enable_tensorboard=m.enable_tensorboard,
                           tensorboard_folder=m.save_tb_folder, progress_bar=m.progress_bar,
                           is_main_process=jax.process_index() == 0)
    with logger:
        args = trainer.model.args
        logger.info(
            f"qwen3 {config.model.flavor}: {trainer.model.num_params() / 1e6:.1f}M params, "
            f"mesh {dict(trainer.mesh.shape)} ({trainer.degrees.mode}), "
            f"{trainer.global_batch_size} x {config.training.seq_len} tokens/step in "
            f"{trainer.options.n_microbatches} microbatch(es), "
            f"param dtype {np.dtype(trainer.options.param_dtype).name}, "
            f"vocab {args.vocab_size}"
        )
        reporter = _StepReporter(config, trainer, logger)
        state = trainer.init_state()
        pending: tuple[int, Any] | None = None
        step = 0
        for step in range(1, config.training.steps + 1):
            batch = trainer.put_batch(next(data))
            state, metrics = trainer.step_fn(state, batch)
            # Read step N-1's metrics only after step N is queued: the device stays busy.
            if pending is not None:
                reporter.report(*pending)
            pending = (step, metrics)
        if pending is not None:
            reporter.report(*pending)
        losses = reporter.losses
        logger.info(f"finished {step} steps: loss {losses[1]:.4f} -> {losses[step]:.4f}")
    return RunResult(step, losses, state)
