"""What XLA:TPU's `temp_size_in_bytes` counts for a scanned model's gradient (docs/MOE.md).

A 2-layer and a 4-layer toy step (a `lax.scan` of remat'ed `tanh(h @ w)` layers, fp32 weights
of 2048 x 2048, its gradient, then an in-place momentum update of the donated weights), compiled
ahead of time for one v5p chip. Prints per variant and depth: `temp_size_in_bytes`, the buffer
assignment's preallocated temporaries (the heap XLA places buffers in) and the peak of live
buffers less the arguments. Measured (jax 0.10.2, libtpu 0.0.42.1): with the layers scanned,
`temp_size_in_bytes` exceeds the heap by 50.4 MB at 2 layers and 84.0 at 4, one more copy of
the stacked fp32 gradient (16.8 MB a layer) and of the carry; unrolled, by 8.5 and 0.2 MB; the
peak follows the heap. MaxText's step (scanned layers too) is measured by the same figure.

`ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu PYTHONPATH=. python
benchmarks/scan_temp_accounting.py` (seconds; any host with libtpu).
"""

from __future__ import annotations

import glob
import re
import tempfile

from titan_jax.jax_platform import compile_only_libtpu

compile_only_libtpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from titan_jax.planner.topology import compile_only_devices, parse_slice  # noqa: E402

DIM, ROWS = 2048, 4096


def preallocated_temp_bytes(dump: str) -> int:
    report = open(glob.glob(f"{dump}/*after_optimizations-buffer-assignment.txt")[0]).read()
    return sum(
        int(m[1])
        for m in re.finditer(r"^allocation \d+: size (\d+), preallocated-temp:?$", report, re.M)
    )


def step_fn(unroll: bool):
    def loss(w, x):
        def layer(h, w_layer):
            return jnp.tanh(h @ w_layer.astype(jnp.bfloat16)), None

        h, _ = jax.lax.scan(jax.checkpoint(layer), x, w, unroll=unroll)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    def step(w, m, x):
        g = jax.grad(loss)(w, x)
        m = 0.9 * m + g
        return w - 0.01 * m, m

    return step


def measure(unroll: bool, layers: int) -> str:
    sharding = jax.sharding.SingleDeviceSharding(compile_only_devices(parse_slice("v5p-8"))[0])
    w = jax.ShapeDtypeStruct((layers, DIM, DIM), jnp.float32, sharding=sharding)
    x = jax.ShapeDtypeStruct((ROWS, DIM), jnp.bfloat16, sharding=sharding)
    with tempfile.TemporaryDirectory() as dump:
        compiled = (
            jax.jit(step_fn(unroll), donate_argnums=(0, 1))
            .lower(w, w, x)
            .compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "^$"})
        )
        heap = preallocated_temp_bytes(dump)
    m = compiled.memory_analysis()
    return (
        f"{'unrolled' if unroll else 'scanned':8s} {layers} layers: temp_size "
        f"{m.temp_size_in_bytes / 1e6:6.1f} MB, heap {heap / 1e6:6.1f} MB, peak less "
        f"arguments {(m.peak_memory_in_bytes - m.argument_size_in_bytes) / 1e6:6.1f} MB"
    )


if __name__ == "__main__":
    for unroll in (False, True):
        for layers in (2, 4):
            print(measure(unroll, layers), flush=True)
