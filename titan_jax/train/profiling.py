"""`[profiling]`: jax.profiler traces of chosen steps, for TensorBoard's profile plugin or Perfetto.

TorchTitan's schedule: of every `profile_freq` steps, the last `profile_steps` are traced, into
`{dump_folder}/{save_traces_folder}/iteration_{N}` where N is the window's last step. The trace
stops only once that step's outputs are ready, so it holds the whole device work of the window.
Open with `tensorboard --logdir {dump_folder}/profile` (Profile tab, needs the
`tensorboard-plugin-profile` package) or load the `.trace.json.gz` file in https://ui.perfetto.dev.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from titan_jax.config import JobConfig
from titan_jax.train.run_folder import run_paths


class StepProfiler:
    """Starts and stops jax.profiler around the configured steps; a no-op when disabled."""

    def __init__(self, config: JobConfig):
        p = config.profiling
        self.enabled = p.enable_profiling
        self.freq, self.steps = p.profile_freq, p.profile_steps
        self.folder = run_paths(config).local / p.save_traces_folder
        self.active: Path | None = None  # the folder being written, while a trace runs

    def before_step(self, step: int) -> None:
        """Starts a trace when `step` opens a window (the window's last step is a multiple of
        profile_freq)."""
        if self.enabled and self.active is None and (step + self.steps - 1) % self.freq == 0:
            self.active = self.folder / f"iteration_{step + self.steps - 1}"
            jax.profiler.start_trace(str(self.active), create_perfetto_trace=True)

    def after_step(self, step: int, outputs: Any) -> Path | None:
        """Stops the trace after a window's last step; returns its folder then, else None."""
        if self.active is None or step % self.freq:
            return None
        jax.block_until_ready(outputs)
        return self.stop()

    def stop(self) -> Path | None:
        """Ends a running trace (also on early exits); returns its folder, or None."""
        folder, self.active = self.active, None
        if folder is not None:
            jax.profiler.stop_trace()
        return folder

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
