"""Each step's on-device metrics turned into logged numbers once they are ready: the loss of
every step, throughput and MFU (`metrics.Throughput`), memory, a validation riding on its
step's line, and the bad-step policy (`bad_steps.BadSteps`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from titan_jax.train.metrics import (
    MetricsLogger,
    Throughput,
    format_validation_line,
    memory_stats,
)
from titan_jax.train.peak_flops import peak_flops_per_device
from titan_jax.train.stopping import BadSteps
from titan_jax.train.trainer import Trainer

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


class StepReporter:
    """Reads step N's metrics (a device sync), logs them, applies the bad-step policy."""

    def __init__(self, trainer: Trainer, logger: MetricsLogger, tokens_seen: int = 0):
        config = trainer.plan.config
        self.logger = logger
        self.tokens_seen = tokens_seen  # over all runs of this job, skipped steps included
        device = trainer.plan.mesh.devices.flat[0]
        dtype = np.dtype(trainer.options.param_dtype).name
        peak = peak_flops_per_device(device, dtype, config.metrics.peak_flops)
        token_flops = trainer.plan.flops_per_token()
        self.throughput = Throughput(
            trainer.plan.tokens_per_step,
            token_flops * trainer.plan.tokens_per_step,
            peak.flops_per_device,
            trainer.plan.mesh.devices.size,
        )
        self.bad_steps = BadSteps(config.training.max_consecutive_bad_steps)
        self.losses: dict[int, float] = {}
        self.validations: dict[int, dict[str, float]] = {}  # by step, until that step is logged
        self.data_metrics: Callable[[int], dict[str, int]] = lambda step: {}
        logger.info(
            f"MFU peak: {peak.flops_per_device / 1e12:.3f} TFLOP/s per device ({peak.source})"
        )
        logger.write_header(
            {
                **peak.to_json(),
                "flops_per_token": token_flops,
                "tokens_per_step": trainer.plan.tokens_per_step,
                "devices": trainer.plan.mesh.devices.size,
                "device_kind": device.device_kind,
                "param_dtype": dtype,
            }
        )

    def report(self, step: int, metrics: dict[str, jax.Array]) -> None:
        values = _scalars(jax.device_get(metrics))
        self.losses[step] = values["loss"]
        self.tokens_seen += int(values["n_tokens"])
        if (line := self.bad_steps.record(step, values)) is not None:
            self.logger.info(line)
        self._log(step, values, force=self.bad_steps.exhausted)
        self.bad_steps.check(step)

    def add_validation(self, step: int, result: dict[str, float]) -> None:
        """Print a validation of `step` now; its loss goes into `step`'s metrics line."""
        self.logger.info(format_validation_line(step, result))
        self.validations[step] = {
            k: v
            for k, v in result.items()  # val_loss, ...
            if k not in ("val_tokens", "val_batches")
        }
        self.throughput.restart()  # the step's wall time includes the validation

    def _log(self, step: int, values: dict[str, float], force: bool) -> None:
        speed = self.throughput.step_finished()
        validation = self.validations.pop(step, {})
        if not (force or validation or self.logger.should_log(step)):
            self.logger.advance(step, loss=values["loss"])  # already on the host: no sync
            return
        mem = memory_stats()
        in_use = mem["bytes_in_use"]
        self.logger.log(
            step,
            {
                "step": step,
                "loss": values["loss"],
                "grad_norm": values["grad_norm"],
                "lr": values["lr"],
                **speed,
                "n_tokens": values["n_tokens"],
                "tokens_seen": self.tokens_seen,
                "memory_peak_gib": mem["peak_bytes"] / 2**30,
                "memory_in_use_gib": None if in_use is None else in_use / 2**30,
                **validation,
                **self.data_metrics(step),
                **{k: v for k, v in values.items() if k not in _STEP_METRICS},  # the model's own
            },
        )
