"""Tests for titan_jax/jax_platform.py: CPU hosts default to JAX_PLATFORMS=cpu, nothing else."""

import importlib.util
import os
import subprocess
import sys

import pytest

from titan_jax import jax_platform


@pytest.fixture
def no_platform_env(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)


def test_cpu_host_gets_cpu(no_platform_env, monkeypatch):
    monkeypatch.setattr(jax_platform.glob, "glob", lambda pattern: [])
    assert jax_platform.default_to_cpu_without_accelerator() == "cpu"
    assert os.environ["JAX_PLATFORMS"] == "cpu"


@pytest.mark.parametrize("node", ["/dev/accel0", "/dev/vfio/0", "/dev/nvidia0"])
def test_accelerator_host_is_left_to_jax(no_platform_env, monkeypatch, node):
    present = {
        "/dev/accel*": "/dev/accel0",
        "/dev/vfio/*": "/dev/vfio/0",
        "/dev/nvidia0": "/dev/nvidia0",
    }
    monkeypatch.setattr(
        jax_platform.glob, "glob", lambda pattern: [node] if present[pattern] == node else []
    )
    assert jax_platform.default_to_cpu_without_accelerator() is None
    assert "JAX_PLATFORMS" not in os.environ


def test_user_value_is_kept(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.setattr(jax_platform.glob, "glob", lambda pattern: [])
    assert jax_platform.default_to_cpu_without_accelerator() == "tpu"


@pytest.mark.slow
def test_cli_on_this_cpu_host_prints_no_tpu_noise():
    if jax_platform.has_accelerator_device():
        pytest.skip("this host has an accelerator")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = (
        "import sys; from titan_jax.cli import main; main(['train', '--print-config']);"
        "import jax; print(jax.default_backend())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().endswith("cpu")
    assert "TPU" not in out.stderr and "INVALID_ARGUMENT" not in out.stderr, out.stderr


def test_libtpu_overlap_flags_are_added_unless_the_user_names_them(monkeypatch):
    from titan_jax.jax_platform import (
        ASYNC_GATHER_FLAGS,
        DEFAULT_LIBTPU_FLAGS,
        default_libtpu_flags,
    )

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert default_libtpu_flags().split() == list(DEFAULT_LIBTPU_FLAGS)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=false --other=1")
    args = default_libtpu_flags().split()
    assert args[:2] == ["--xla_enable_async_all_gather=false", "--other=1"]
    assert "--xla_enable_async_all_gather=true" not in args
    assert set(ASYNC_GATHER_FLAGS[1:]) <= set(args)
    assert default_libtpu_flags().split() == args  # idempotent


GATHER_PROGRAM = """
from titan_jax import jax_platform
jax_platform.compile_only_libtpu()
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
for name in ("v5p:2x2x1", "v6e:2x2", "v5e:2x2"):
    mesh = Mesh(topologies.get_topology_desc(platform="tpu", topology_name=name).devices,
                ("fsdp",))
    x = jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    gather = jax.shard_map(lambda x: jax.lax.all_gather(x, "fsdp", tiled=True) @ x.T,
                           mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    hlo = jax.jit(gather).lower(x).compile().as_text()
    print(name, "sparsecore" if 'async_execution_thread="sparsecore"' in hlo else "tensorcore")
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_the_default_libtpu_flags_compile_on_every_tpu_generation():
    """The flags `compile` and `train` add are ones this libtpu takes on v5p, v6e and v5e (0.0.50
    refuses the fused all-gather continuation MaxText's older recipes set on all but v5e), and
    they run the FSDP gather on the SparseCores where a chip has them (not v5e)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LIBTPU_INIT_ARGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [sys.executable, "-c", GATHER_PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [
        "v5p:2x2x1",
        "sparsecore",
        "v6e:2x2",
        "sparsecore",
        "v5e:2x2",
        "tensorcore",
    ]
