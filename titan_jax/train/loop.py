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
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from titan_jax.config import JobConfig
from titan_jax.data.windows import WindowStream
from titan_jax.models.spec import ModelArgs
from titan_jax.parallel.distributed import JobFailures, exit_job, initialize_distributed
from titan_jax.train.checkpoint import Checkpointer, CheckpointError, NonFiniteStateError, Restored
from titan_jax.train.goodput import GoodputRecorder
from titan_jax.train.metrics import MetricsLogger
from titan_jax.train.model_io import export_hf
from titan_jax.train.preflight import check_history
from titan_jax.train.profiling import StepProfiler
from titan_jax.train.run_folder import RunMirror, RunPaths, run_paths
from titan_jax.train.run_lock import RunLock, prepare_dump_folder, tidy_if_refused
from titan_jax.train.run_log import RunLog
from titan_jax.train.setup import RunSetup, assemble_run, open_data
from titan_jax.train.start import load_start
from titan_jax.train.step import TrainState
from titan_jax.train.step_report import StepReporter
from titan_jax.train.stopping import BadStepsError, StepWatchdog, StopSignals
from titan_jax.train.trainer import Trainer

if TYPE_CHECKING:  # imported by runs with a local tier only (grain is slow to import)
    from titan_jax.train.local_tier import LocalTier


@dataclasses.dataclass
class RunResult:
    final_step: int
    losses: dict[int, float]  # the loss of every step this run trained, by step number
    state: TrainState | None  # None when there was nothing left to train
    stopped_by: str | None = None  # the signal that stopped the run early


class StepTimeoutError(RuntimeError):
    """A step did not finish within `distributed.step_timeout`."""


@dataclasses.dataclass
class _Run:
    """What the step loop works with, once the run is open."""

    config: JobConfig
    setup: RunSetup
    ckpt: Checkpointer | None
    local: LocalTier | None  # the local tier of multi-tier checkpoints (train/local_tier.py)
    mirror: RunMirror | None  # a URL run folder's copy here (train/run_folder.py)
    logger: MetricsLogger
    stop: StopSignals
    profiler: StepProfiler
    watchdog: StepWatchdog
    goodput: GoodputRecorder
    step_reporter: StepReporter | None = None  # made once the first state is there

    @property
    def reporter(self) -> StepReporter:
        if self.step_reporter is None:
            raise RuntimeError("a step is reported before the run's StepReporter exists")
        return self.step_reporter


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
        for p, a in enumerate(every)
    )


def train(
    config: JobConfig,
    devices: list[jax.Device] | None = None,
    model_args: ModelArgs | None = None,
    started_at: float | None = None,
) -> RunResult:
    """Trains (or resumes) up to `training.steps`; returns this run's losses and final state.
    `model_args` replaces `model.flavor`'s shape (tests and notebooks train tiny models).
    `started_at`: when this run's startup began (Unix seconds; default now), for goodput.

    Joins the multi-process job of `[distributed]` first; with several processes, an error on
    one of them ends all of them with its message (`JobFailures`).
    """
    started_at = time.time() if started_at is None else started_at
    initialize_distributed(config.distributed)
    with JobFailures(config.distributed.heartbeat_timeout) as failures:
        return _train(config, devices, model_args, failures, started_at)


def _train(
    config: JobConfig,
    devices: list[jax.Device] | None,
    model_args: ModelArgs | None,
    failures: JobFailures,
    started_at: float,
) -> RunResult:
    # Every check that needs no lock; nothing written.
    setup = assemble_run(config, devices, model_args)
    paths = run_paths(config)
    with contextlib.ExitStack() as stack:
        if jax.process_index() == 0:  # exits last: after the locks are gone
            stack.enter_context(tidy_if_refused(paths.local))
        goodput = GoodputRecorder(jax.process_index() == 0, started_at, config.job.dump_folder)
        mirror, ckpt, local, start = _open(stack, config, setup, paths, goodput)
        logger = stack.enter_context(
            MetricsLogger(
                paths.local,
                config.metrics.log_freq,
                config.training.steps,
                enable_tensorboard=config.metrics.enable_tensorboard,
                tensorboard_folder=config.metrics.save_tb_folder,
                progress_bar=config.metrics.progress_bar,
                plot_loss=config.metrics.plot_loss,
                is_main_process=jax.process_index() == 0,
                enable_wandb=config.metrics.enable_wandb,
                run_config=config.to_dict(),
                keep_through=start.step,
            )
        )
        goodput.started(paths.local, start.step, logger.info)
        stack.enter_context(goodput)  # its end record: after the last save's wait
        run = _Run(
            config,
            setup,
            ckpt,
            local,
            mirror,
            logger,
            stack.enter_context(StopSignals(logger.info)),
            stack.enter_context(StepProfiler(config)),
            stack.enter_context(
                StepWatchdog(config.distributed.step_timeout, _end_hung_job(failures))
            ),
            goodput,
        )
        failures.activity = run.watchdog.activity  # what the heartbeat says this process does
        # Exits first: the other processes hear of an error before cleanups that wait on them.
        stack.enter_context(failures.guard())
        logger.info(_summary(setup.trainer))
        if setup.shape_note is not None:
            logger.info(setup.shape_note)
        if start.step >= config.training.steps:
            logger.info(
                f"nothing to train: {start.source} is at step {start.step} and "
                f"training.steps={config.training.steps}; raise training.steps to train "
                "on, or use a new job.dump_folder"
            )
            return RunResult(start.step, {}, None)
        state = _first_state(setup.trainer, start, logger)
        if start.data_state is not None and setup.data.resume_note:
            logger.info(setup.data.resume_note)
        run.step_reporter = StepReporter(setup.trainer, logger, start.tokens_seen)
        if len(setup.data.sources) > 1:  # a mixture: tokens per source in the metrics
            run.reporter.data_metrics = lambda step: {
                f"tokens_seen/{name}": n
                for name, n in setup.data.source_tokens(step - start.step).items()
            }
        step, state, stopped = _run_steps(run, state, start.step)
        with run.watchdog.paused(f"finishing after step {step}"):
            return _finish(run, step, state, stopped)


def _open(
    stack: contextlib.ExitStack,
    config: JobConfig,
    setup: RunSetup,
    paths: RunPaths,
    goodput: GoodputRecorder,
) -> tuple[RunMirror | None, Checkpointer | None, LocalTier | None, Restored]:
    """Takes the run's folders (locks, or a URL's lease and its files copied here), opens its
    log and checkpoints, and finds where it starts, with its data position set: all before the
    first metrics line is written."""
    main = jax.process_index() == 0
    mirror = None
    if paths.url is not None:  # its exit, last, copies out what the run wrote
        mirror = stack.enter_context(RunMirror(paths, main))
    elif main:  # one run per folder, taken before anything is written there
        stack.enter_context(RunLock(paths.local))
    else:  # the lock is process 0's; a host of its own may still lack the folder
        prepare_dump_folder(paths.local)
    if main:
        check_history(config)
    stack.enter_context(RunLog(paths.local))
    ckpt = None
    if config.checkpoint.enable:
        # An absolute checkpoint.folder may be another run's too: locked on its own. (Inside a
        # URL run folder, the lease covers it.)
        if main and (paths.url is None or Path(config.checkpoint.folder).is_absolute()):
            stack.enter_context(RunLock(paths.checkpoints, "checkpoint.folder"))
        # Closed (waiting for an in-flight save) on every exit, errors and signals included.
        ckpt = stack.enter_context(Checkpointer.for_run(setup.trainer))
    local = None
    if ckpt is not None and config.checkpoint.local_folder:
        from titan_jax.train.local_tier import LocalTier

        local = stack.enter_context(LocalTier.for_run(setup.trainer, ckpt))
    with goodput.phase("checkpoint_restore"):
        start = load_start(setup.trainer, ckpt, local)
    open_data(setup)
    if start.data_state is not None:
        try:
            setup.data.set_state(start.data_state)
        except (ValueError, KeyError, IndexError, TypeError) as e:  # a damaged data item
            raise CheckpointError(f"cannot resume from {start.source}: {e}") from e
    return mirror, ckpt, local, start


def _end_hung_job(failures: JobFailures) -> Callable[[str], None]:
    def end(message: str) -> None:
        failures.report(StepTimeoutError(message))  # the other processes end with it
        exit_job(message, 1)

    return end


def _summary(trainer: Trainer) -> str:
    config = trainer.plan.config
    return (
        f"{config.model.name} {config.model.flavor}: "
        f"{trainer.plan.model.num_params() / 1e6:.1f}M params, "
        f"mesh {dict(trainer.plan.mesh.shape)} ({trainer.plan.degrees.mode}), "
        f"{trainer.plan.global_batch_size} x {config.training.seq_len} tokens/step in "
        f"{trainer.options.n_microbatches} microbatch(es), "
        f"param dtype {np.dtype(trainer.options.param_dtype).name}, "
        f"vocab {trainer.plan.model.args.vocab_size}"
    )


def _first_state(trainer: Trainer, start: Restored, logger: MetricsLogger) -> TrainState:
    if start.state is None:
        return trainer.init_state()
    verb = f"resuming at step {start.step + 1} from" if start.step else "starting from"
    logger.info(f"{verb} {start.source} ({start.tokens_seen:,} tokens seen)")
    return start.state


def _run_steps(run: _Run, state: TrainState, first: int) -> tuple[int, TrainState, bool]:
    """Steps after `first` up to `training.steps`, or until a stop signal; returns (the last
    step, its state, whether a signal stopped the run)."""
    config, trainer, reporter = run.config, run.setup.trainer, run.reporter
    validator, c, goodput = run.setup.validator, config.checkpoint, run.goodput
    pending: tuple[int, Any] | None = None
    stopped, step = False, first
    goodput.training()
    for step in range(first + 1, config.training.steps + 1):
        with goodput.phase("data_loading"):
            batch = trainer.batches.put(next(run.setup.data), seq_len=run.setup.data.seq_len)
        run.profiler.before_step(step)
        with goodput.phase("compilation"):  # the first call traces and compiles
            state, metrics = trainer.step_fn(state, batch)
        goodput.dispatched(metrics)
        # Read step N-1's metrics only after step N is queued: the device stays busy.
        if pending is not None:
            _report(run, *pending)
            run.watchdog.beat(pending[0])
            if run.mirror is not None:
                run.mirror.sync_now_and_then()
        pending = (step, metrics)
        if (trace := run.profiler.after_step(step, (state, metrics))) is not None:
            run.logger.info(f"profile of steps up to {step} written to {trace}")
        if validator is not None and validator.should_validate(step):
            with run.watchdog.paused(f"validating at step {step}"), goodput.phase("evaluation"):
                reporter.add_validation(step, validator.validate(state))
        stopped = run.stop.should_stop(step)
        saver: Checkpointer | LocalTier | None = None
        if run.ckpt is not None and (
            stopped or step == config.training.steps or step % c.interval == 0
        ):
            saver = run.ckpt
        elif run.local is not None and step % c.local_interval == 0:
            saver = (
                run.local
            )  # never beside a persistent save: one host copy of the state at a time
        if saver is not None:
            _report(run, *pending)  # N's verdict (bad-step policy) before N is saved
            run.watchdog.beat(step)
            pending = None
            goodput.interval()  # a resume point is a record boundary
            what = "checkpoint" if isinstance(saver, Checkpointer) else "local checkpoint"
            with run.watchdog.paused(f"saving {what} {step}"), goodput.phase("checkpoint_save"):
                _save(run, saver, step, state)
        if stopped:
            break
    if pending is not None:
        _report(run, *pending)
    return step, state, stopped


def _report(run: _Run, step: int, metrics: Any) -> None:
    """Reads and logs `step`'s metrics; a logged step also ends a goodput interval."""
    run.reporter.report(step, metrics)
    run.goodput.reported(step)
    if run.logger.should_log(step):
        run.goodput.interval()


def _finish(run: _Run, step: int, state: TrainState, stopped: bool) -> RunResult:
    config, ckpt, logger = run.config, run.ckpt, run.logger
    if ckpt is not None:
        with run.goodput.phase("checkpoint_save"):
            ckpt.wait()
            if run.local is not None:
                run.local.wait()
    if jax.process_count() > 1:
        logger.info(data_summary(run.setup.data))
    losses = run.reporter.losses
    if stopped and step < config.training.steps:
        saved = (
            f"saved checkpoint step {step} in {ckpt.directory}; run the same command to resume"
            if ckpt is not None
            else "checkpoint.enable=false: nothing saved"
        )
        logger.info(f"{run.stop.reason}: stopped after step {step}; {saved}")
        run.goodput.ending = run.stop.reason
        return RunResult(step, losses, state, run.stop.reason)
    if config.checkpoint.last_save_in_hf:
        path = export_hf(run.setup.trainer, state["params"], step)
        logger.info(f"final model saved as HF safetensors in {path}")
    first = min(losses)
    logger.info(
        f"finished step {step}: loss {losses[first]:.4f} (step {first}) -> {losses[step]:.4f}"
    )
    return RunResult(step, losses, state)


def _save(run: _Run, saver: Checkpointer | LocalTier, step: int, state: TrainState) -> None:
    """Saves `step` to the persistent tier (`run.ckpt`) or the local one (`run.local`)."""
    c = run.config.checkpoint
    persistent = isinstance(saver, Checkpointer)
    model_only = persistent and step == run.config.training.steps and c.last_save_model_only
    data_state, tokens_seen = run.setup.data.get_state(), run.reporter.tokens_seen
    start = time.perf_counter()
    try:
        if isinstance(saver, Checkpointer):
            writing = saver.save(
                step,
                state,
                data_state=data_state,
                tokens_seen=tokens_seen,
                model_only=model_only,
                dtype=c.export_dtype if model_only else None,
            )
        else:
            writing = saver.save(step, state, data_state=data_state, tokens_seen=tokens_seen)
    except NonFiniteStateError as e:
        raise BadStepsError(str(e)) from e
    what = f"model only, {c.export_dtype}" if model_only else "full state"
    saved = f"checkpoint step {step} ({what})" if persistent else f"local checkpoint step {step}"
    run.logger.info(
        f"{saved}: {time.perf_counter() - start:.1f} s "
        f"blocking{', writing in the background' if writing else ', written'}"
    )
    if persistent and run.mirror is not None:  # the run's record at the URL reaches it
        run.mirror.sync()
