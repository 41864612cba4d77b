"""Fixtures of the parallelism tests: one tiny-model init and data shared by every mesh."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import pytest
from parallel_helpers import make_batches, run_losses, single_device_overrides, tiny_trainer


@pytest.fixture(scope="session")
def tiny_batches() -> list[dict[str, np.ndarray]]:
    return make_batches(20)


@pytest.fixture(scope="session")
def tiny_init_state() -> object:
    """One random init (on one device, as host arrays) that every mesh starts from."""
    return jax.device_get(tiny_trainer(*single_device_overrides(), n_devices=1).init_state())


@pytest.fixture(scope="session")
def run_tiny(
    tiny_init_state: object, tiny_batches: list[dict[str, np.ndarray]]
) -> Callable[..., np.ndarray]:
    """run_tiny(*overrides, n_devices=8) -> the 20 step losses from the shared init."""

    def run(*overrides: str, n_devices: int = 8) -> np.ndarray:
        return run_losses(
            tiny_trainer(*overrides, n_devices=n_devices), tiny_init_state, tiny_batches
        )

    return run
