"""The notebooks run as a user runs them: on the host's one CPU device. tests/conftest.py
simulates 8 devices for the test process through XLA_FLAGS, and nbmake's kernels inherit that
environment; the sharding explorer (03) asks for its own 8 devices."""

import os
from collections.abc import Iterator

import pytest

from titan_jax.parallel.mesh import xla_flags_with_cpu_devices


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    saved = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = xla_flags_with_cpu_devices(saved or "", None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved
