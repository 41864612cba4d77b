"""The host loop: data -> step -> metrics -> checkpoint policy, with preemption and NaN policy.

Metrics are read one step behind (step N's after step N+1 is queued) so the host never stalls
the device; at a checkpoint step the loop reads step N's verdict first, so the bad-step policy
has spoken before N's state is saved.

- Start: the run's own newest checkpoint (resume), else `checkpoint.initial_load_path`, else
  random init; see `start.load_start`.
- Checkpoints: every `checkpoint.interval` steps, at the last step (model only and in
  `export_dtype` when `last_save_model_only`), and when stopped by a signal.
- Preemption: SIGTERM or SIGINT finishes the current step, saves it and returns normally.
- Bad steps: a non-finite step is skipped by the step's finite guard and reported here;
  `training.max_consecutive_bad_steps` in a row raise BadStepsError without saving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from titan_jax.config import ConfigError, JobConfig
from titan_jax.data.pipeline import check_inputs, process_barrier, training_sources
from titan_jax.data.tokenizer import Tokenizer, load_tokenizer
from titan_jax.data.windows import WindowStream
from titan_jax.parallel.distributed import JobFailures, initialize_distributed
from titan_jax.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    NonFiniteStateError,
)
from titan_jax.train.eval import Validator
from titan_jax.train.metrics import MetricsLogger, format_validation_line, memory_stats
from titan_jax.train.model_io import export_hf
from titan_jax.train.peak_flops import peak_flops_per_device
from titan_jax.train.profiling import StepProfiler
from titan_jax.train.run_lock import RunLock, prepare_dump_folder
from titan_jax.train.run_log import RunLog
from titan_jax.train.start import check_initial_load_path, load_start
from titan_jax.train.step import TrainState
from titan_jax.train.trainer import Trainer, build_trainer


class BadStepsError(RuntimeError):
    """Too many non-finite steps in a row: the run stops instead of training on garbage."""


@dataclasses.dataclass
class RunResult:
    final_step: int
    losses: dict[int, float]  # the loss of every step this run trained, by step number
    state: TrainState | None  # None when there was nothing left to train
    stopped_by: str | None = None  # the signal that stopped the run early


class StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step (and save it).

    One process: the handler sets a flag. Several processes must all stop at the same step, so
    there SIGTERM is left to JAX's preemption service (which `jax.distributed.initialize`
    installs, and which picks a step every process reaches) and a Ctrl-C is forwarded to it as
    SIGTERM. A second signal gets the previous handler: Ctrl-C twice quits at once.
    """

    def __init__(self, notify: Callable[[str], None]):
        self.received: str | None = None
        self._notify = notify
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            multi = jax.process_count() > 1
            for sig in (signal.SIGINT,) if multi else (signal.SIGINT, signal.SIGTERM):
                previous = signal.signal(sig, self._handle)
                self._previous[sig] = signal.SIG_DFL if previous is None else previous
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        signal.signal(signum, self._previous.pop(signum))
        self._notify(f"{self.received} received: stopping after the current step and saving it "
                     "(send it again to quit at once)")
        if jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step`; every process must call this at every step."""
        if jax.process_count() == 1:
            return self.received is not None
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the preemption service is disabled: signals kill as usual
            return False

    @property
    def reason(self) -> str:
        return self.received or "preemption notice"


def _progress(message: str) -> None:
    if jax.process_index() == 0:
        print(f"titan-jax: {message}", flush=True)


def check_data(config: JobConfig, trainer: Trainer) -> Tokenizer:
    """The run's tokenizer, once its vocabulary fits the model and every input exists."""
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    if tokenizer.vocab_size > trainer.model.args.vocab_size:
        raise ConfigError(
            f"tokenizer {config.model.tokenizer_path or '(shipped)'} has vocab size "
            f"{tokenizer.vocab_size}, larger than model.flavor={config.model.flavor}'s "
            f"vocab_size={trainer.model.args.vocab_size}"
        )
    if config.training.document_mask and trainer.attention == "cudnn":
        raise ConfigError("training.document_mask=true needs model.attention=xla or splash: "
                          "the cudnn attention here takes no segment ids")
    check_inputs(config, tokenizer)
    return tokenizer


def build_data(config: JobConfig, trainer: Trainer, tokenizer: Tokenizer | None = None
               ) -> WindowStream:
    """The training windows of this process's rows (small sources become a token store under
    the dump folder first: data/pipeline.py). `tokenizer`: from `check_data`, else checked here."""
    tokenizer = check_data(config, trainer) if tokenizer is None else tokenizer
    t = config.training
    sources = training_sources(config, tokenizer, is_first=jax.process_index() == 0,
                               barrier=process_barrier, progress=_progress)
    return WindowStream(sources, seq_len=t.seq_len, global_batch_size=trainer.global_batch_size,
                        seed=t.seed, rows=trainer.batch_rows(), document_mask=t.document_mask,
                        document_positions=t.document_positions)


def _rows_text(rows: np.ndarray) -> str:
    """Row numbers as ranges: 0-3,8-11."""
    runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs if len(r))


def data_summary(data: WindowStream) -> str:
    """Which rows of the global batch each process read, and how many windows (a collective:
    every process calls it)."""
    mine = np.zeros(data.global_batch_size + 1, np.int32)
    mine[data.rows] = 1
    mine[-1] = (data.samples - data.samples_at_start) // data.global_batch_size * len(data.rows)
    every = np.asarray(multihost_utils.process_allgather(mine))
    return "data: " + ", ".join(
        f"process {p} read rows {_rows_text(np.flatnonzero(a[:-1]))} ({a[-1]} windows)"
        for p, a in enumerate(every))


class _StepReporter:
    """Turns each step's on-device metrics into logged numbers once they are ready."""

    def __init__(self, config: JobConfig, trainer: Trainer, logger: MetricsLogger,
                 tokens_seen: int = 0):
        self.config, self.trainer, self.logger = config, trainer, logger
        self.tokens_seen = tokens_seen  # over all runs of this job, skipped steps included
        device = trainer.mesh.devices.flat[0]
        dtype = np.dtype(trainer.options.param_dtype).name
        peak = peak_flops_per_device(device, dtype, config.metrics.peak_flops)
        self.peak = peak.flops_per_device
        token_flops = trainer.flops_per_token()
        self.flops_per_step = token_flops * trainer.tokens_per_step
        self.n_devices = trainer.mesh.devices.size
        self.bad_in_a_row = 0
        self.losses: dict[int, float] = {}
        self.last_ready: float | None = None
        self.validations: dict[int, dict[str, float]] = {}  # by step, until that step is logged
        self.data_metrics: Callable[[int], dict[str, int]] = lambda step: {}
        logger.info(f"MFU peak: {self.peak / 1e12:.3f} TFLOP/s per device ({peak.source})")
        logger.write_header({**peak.to_json(), "flops_per_token": token_flops,
                             "tokens_per_step": trainer.tokens_per_step,
                             "devices": self.n_devices, "device_kind": device.device_kind,
                             "param_dtype": dtype})

    def report(self, step: int, metrics: dict[str, jax.Array]) -> None:
        values = _scalars(jax.device_get(metrics))
        self.losses[step] = values["loss"]
        self.tokens_seen += int(values["n_tokens"])
        if values["finite"]:
            self.bad_in_a_row = 0
        else:
            self.bad_in_a_row += 1
            self.logger.info(f"step {step}: non-finite loss={values['loss']} or "
                             f"grad_norm={values['grad_norm']}; update skipped "
                             f"({self.bad_in_a_row} in a row)")
        limit = self.config.training.max_consecutive_bad_steps
        self._log(step, values, force=self.bad_in_a_row >= limit)
        if self.bad_in_a_row >= limit:
            raise BadStepsError(
                f"{self.bad_in_a_row} non-finite steps in a row (training."
                f"max_consecutive_bad_steps={limit}); stopping at step {step} without saving it"
            )

    def add_validation(self, step: int, result: dict[str, float]) -> None:
        """Print a validation of `step` now; its loss goes into `step`'s metrics line."""
        self.logger.info(format_validation_line(step, result))
        self.validations[step] = {k: result[k] for k in ("val_loss", "val_perplexity")}
        self.last_ready = None  # the step's wall time includes the validation: not a step time

    def _log(self, step: int, values: dict[str, float], force: bool) -> None:
        now = time.perf_counter()
        step_time = None if self.last_ready is None else now - self.last_ready
        self.last_ready = now
        validation = self.validations.pop(step, {})
        if not (force or validation or self.logger.should_log(step)):
            self.logger.advance(step, loss=values["loss"])  # already on the host: no sync
            return
        # The first step of a run includes compilation: its throughput is not measured (null).
        tps = mfu = None
        if step_time:
            tps = self.trainer.tokens_per_step / step_time
            mfu = 100 * self.flops_per_step / step_time / (self.peak * self.n_devices)
        mem = memory_stats()
        in_use = mem["bytes_in_use"]
        self.logger.log(step, {
            "step": step, "loss": values["loss"], "grad_norm": values["grad_norm"],
            "lr": values["lr"], "tokens_per_sec": tps, "mfu_pct": mfu,
            "step_time_s": step_time, "n_tokens": values["n_tokens"],
            "tokens_seen": self.tokens_seen, "memory_peak_gib": mem["peak_bytes"] / 2**30,
            "memory_in_use_gib": None if in_use is None else in_use / 2**30, **validation,
            **self.data_metrics(step),
            **{k: v for k, v in values.items() if k not in _STEP_METRICS},  # the model's own
        })


# What every train step reports; anything else comes from the model's aux channel.
_STEP_METRICS = ("loss", "grad_norm", "lr", "n_tokens", "finite")


def _scalars(metrics: dict[str, np.ndarray]) -> dict[str, float]:
    """Host metrics as floats; a per-layer array `x` becomes `x/0`, `x/1`, ..."""
    out = {}
    for key, value in metrics.items():
        value = np.asarray(value)
        if value.ndim == 0:
            out[key] = float(value)
        else:
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value.reshape(-1))})
    return out


def train(config: JobConfig, devices: list[jax.Device] | None = None) -> RunResult:
    """Trains (or resumes) up to `training.steps`; returns this run's losses and final state.

    Joins the multi-process job of `[distributed]` first; with several processes, an error on
    one of them ends all of them with its message (`JobFailures`).
    """
    initialize_distributed(config.distributed)
    with JobFailures() as failures:
        return _train(config, devices, failures)


def _train(config: JobConfig, devices: list[jax.Device] | None,
           failures: JobFailures) -> RunResult:
    trainer = build_trainer(config, devices)
    tokenizer = check_data(config, trainer)  # before anything is written
    m, c = config.metrics, config.checkpoint
    total = config.training.steps
    check_initial_load_path(config)
    with contextlib.ExitStack() as stack:
        # One run per dump folder, taken before anything is written there.
        if jax.process_index() == 0:
            stack.enter_context(RunLock(config.job.dump_folder))
        else:  # the lock is process 0's; a host of its own may still lack the folder
            prepare_dump_folder(config.job.dump_folder)
        stack.enter_context(RunLog(config.job.dump_folder))
        # Closed (waiting for an in-flight save) on every exit, errors and signals included.
        ckpt = stack.enter_context(Checkpointer.from_config(config, trainer)) if c.enable else None
        # Before any log is opened: a bad checkpoint or config change fails with nothing written.
        start = load_start(config, trainer, ckpt)
        # Under the run lock: small sources are prepared into a store in the dump folder.
        data = build_data(config, trainer, tokenizer)
        validator = Validator(config, trainer, tokenizer) if config.validation.enable else None
        logger = stack.enter_context(MetricsLogger(
            config.job.dump_folder, m.log_freq, total, enable_tensorboard=m.enable_tensorboard,
            tensorboard_folder=m.save_tb_folder, progress_bar=m.progress_bar,
            is_main_process=jax.process_index() == 0, enable_wandb=m.enable_wandb,
            run_config=config.to_dict(), keep_through=start.step))
        stop = stack.enter_context(StopSignals(logger.info))
        profiler = stack.enter_context(StepProfiler(config))
        # Exits first: the other processes hear of an error before cleanups that wait on them.
        stack.enter_context(failures.guard())
        args = trainer.model.args
        logger.info(
            f"{config.model.name} {config.model.flavor}: "
            f"{trainer.model.num_params() / 1e6:.1f}M params, "
            f"mesh {dict(trainer.mesh.shape)} ({trainer.degrees.mode}), "
            f"{trainer.global_batch_size} x {config.training.seq_len} tokens/step in "
            f"{trainer.options.n_microbatches} microbatch(es), "
            f"param dtype {np.dtype(trainer.options.param_dtype).name}, "
            f"vocab {args.vocab_size}"
        )
        if start.step >= total:
            logger.info(f"nothing to train: {start.source} is at step {start.step} and "
                        f"training.steps={total}; raise training.steps to train on, or use a "
                        "new job.dump_folder")
            return RunResult(start.step, {}, None)
        if start.state is None:
            state = trainer.init_state()
        else:
            state = start.state
            verb = f"resuming at step {start.step + 1} from" if start.step else "starting from"
            logger.info(f"{verb} {start.source} ({start.tokens_seen:,} tokens seen)")
        if start.data_state is not None:
            try:
                data.set_state(start.data_state)
            except ValueError as e:
                raise CheckpointError(f"cannot resume from {start.source}: {e}") from e
            if data.resume_note:
                logger.info(data.resume_note)

        reporter = _StepReporter(config, trainer, logger, start.tokens_seen)
        if len(data.sources) > 1:  # a mixture: tokens per source in the metrics
            reporter.data_metrics = lambda step: {
                f"tokens_seen/{name}": n
                for name, n in data.source_tokens(step - start.step).items()}
        pending: tuple[int, Any] | None = None
        stopped = False
        step = start.step
        for step in range(start.step + 1, total + 1):
            batch = trainer.put_batch(next(data))
            profiler.before_step(step)
            state, metrics = trainer.step_fn(state, batch)
            # Read step N-1's metrics only after step N is queued: the device stays busy.
            if pending is not None:
                reporter.report(*pending)
            pending = (step, metrics)
            if (trace := profiler.after_step(step, (state, metrics))) is not None:
                logger.info(f"profile of steps up to {step} written to {trace}")
            if validator is not None and validator.should_validate(step):
                reporter.add_validation(step, validator.validate(state["params"], state["buffers"]))
            stopped = stop.should_stop(step)
            if ckpt is not None and (stopped or step == total or step % c.interval == 0):
                reporter.report(*pending)  # N's verdict (bad-step policy) before N is saved
                pending = None
                _save(ckpt, config, step, state, data, reporter, logger)
            if stopped:
                break
        if pending is not None:
            reporter.report(*pending)
        if ckpt is not None:
            ckpt.wait()
        if jax.process_count() > 1:
            logger.info(data_summary(data))
        losses = reporter.losses
        first = min(losses)
        if stopped and step < total:
            saved = (f"saved checkpoint step {step} in {ckpt.directory}; run the same command "
                     "to resume" if ckpt is not None else "checkpoint.enable=false: nothing saved")
            logger.info(f"{stop.reason}: stopped after step {step}; {saved}")
            return RunResult(step, losses, state, stop.reason)
        if c.last_save_in_hf:
            path = export_hf(config, trainer, state["params"], step)
            logger.info(f"final model saved as HF safetensors in {path}")
        logger.info(f"finished step {step}: loss {losses[first]:.4f} (step {first}) -> "
                    f"{losses[step]:.4f}")
    return RunResult(step, losses, state)


def _save(ckpt: Checkpointer, config: JobConfig, step: int, state: TrainState,
          data: WindowStream, reporter: _StepReporter, logger: MetricsLogger) -> None:
    c = config.checkpoint
    model_only = step == config.training.steps and c.last_save_model_only
    start = time.perf_counter()
    try:
        ckpt.save(step, state, data_state=data.get_state(), tokens_seen=reporter.tokens_seen,
                  model_only=model_only, dtype=c.export_dtype if model_only else None)
    except NonFiniteStateError as e:
        raise BadStepsError(str(e)) from e
    what = f"model only, {c.export_dtype}" if model_only else "full state"
    logger.info(f"checkpoint step {step} ({what}): {time.perf_counter() - start:.1f} s "
                f"blocking{', writing in the background' if c.async_mode == 'async' else ''}")
