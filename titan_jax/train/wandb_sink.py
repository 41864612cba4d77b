"""Optional Weights & Biases sink for the metrics (`metrics.enable_wandb`), TorchTitan style.

wandb is an optional extra (`pip install -e '.[wandb]'`), imported only when enabled. The run
goes to project `$WANDB_PROJECT` (default "titan-jax") with the resolved config attached, and
its files under the dump folder. `WANDB_MODE=offline` logs without a network or an account
(`wandb sync` uploads later), as wandb's own environment variables allow.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titan_jax.config import ConfigError


class WandbSink:
    """One wandb run; `log` takes the same records as metrics.jsonl, under TensorBoard's tags."""

    def __init__(self, folder: Path, run_config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError("metrics.enable_wandb=true needs the wandb package: "
                              "`.venv/bin/pip install -e '.[wandb]'`") from None
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "titan-jax"),
                               dir=str(folder), config=run_config, name=folder.name)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
