"""Tests run on 8 simulated CPU devices (set before JAX starts its backend)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Once JAX's thread pool has run, torch's spinning OpenMP workers slow it ~20x on 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"]
)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
