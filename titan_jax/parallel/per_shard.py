"""Kernels the partitioner cannot split (Pallas), run on each device's own shard.

GSPMD treats a Pallas kernel as an opaque call: left alone under a sharded jit it would be run
on gathered (replicated) inputs, or fail to partition. Such a kernel works on any slice of its
batch and head axes, so SimpleFSDP runs it under `jax.shard_map` with the activation specs of
the rules table (`SimpleFSDP.run_per_shard`).

Pallas kernels carry no varying-axes types (their outputs are typed as replicated), so they
need `check_vma=False`. Inside SimpleFSDP's shard_map twin, which is type-checked (its
collectives' transposes depend on it), differentiating such a kernel fails: the kernel's
backward returns untyped cotangents for typed (varying) inputs. `typed_kernel` wraps it in a
custom_vjp whose forward and backward run unchecked and are re-typed as varying over the data
axes they really vary over; the backward is the kernel's own VJP, traced on untyped abstract
inputs and evaluated on the typed ones (it recomputes the kernel's forward: the twin is a
cross-check, not the fast path).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, PartitionSpec

Kernel = Callable[..., jax.Array]


def jit_per_shard(mesh: Mesh, kernel: Kernel, args: tuple[jax.Array, ...],
                  in_specs: tuple[PartitionSpec, ...], out_spec: PartitionSpec) -> jax.Array:
    """The jit path: `kernel` under shard_map over the whole mesh. Called inside SimpleFSDP's
    vmap over data shards (spmd_axis_name = the data axes), whose batching rule adds the data
    axes to the shard dim: each device runs the kernel on its own rows."""
    return jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                         check_vma=False)(*args)


def manual_per_shard(kernel: Kernel, args: tuple[jax.Array, ...],
                     in_specs: tuple[PartitionSpec, ...], out_spec: PartitionSpec,
                     data_axes: tuple[str, ...]) -> jax.Array:
    """The shard_map path: the data axes are already manual; a nested shard_map maps the
    model-parallel axes the specs name (none: the kernel sees this shard whole)."""
    model_axes = frozenset(a for spec in (*in_specs, out_spec) for entry in spec if entry
                           for a in (entry if isinstance(entry, tuple) else (entry,)))

    def unchecked(f: Kernel, specs: tuple[PartitionSpec, ...], out: object) -> Kernel:
        return jax.shard_map(f, in_specs=specs, out_specs=out, axis_names=model_axes,
                             check_vma=False)

    def vary(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in data_axes if a not in jax.typeof(x).mat.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    def kernel_vjp(*primals_and_ct: jax.Array) -> tuple[jax.Array, ...]:
        # Traced on untyped abstract values (autodiff then type-checks), run on typed ones.
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in primals_and_ct]
        closed = jax.make_jaxpr(lambda *a: jax.vjp(kernel, *a[:-1])[1](a[-1]))(*abstract)
        return tuple(jaxpr_as_fun(closed)(*primals_and_ct))

    @jax.custom_vjp
    def typed_kernel(*xs: jax.Array) -> jax.Array:
        return vary(unchecked(kernel, in_specs, out_spec)(*xs))

    def fwd(*xs: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return typed_kernel(*xs), xs

    def bwd(xs: tuple[jax.Array, ...], g: jax.Array) -> tuple[jax.Array, ...]:
        cts = unchecked(kernel_vjp, (*in_specs, out_spec), in_specs)(*xs, g)
        return tuple(vary(ct) for ct in cts)

    typed_kernel.defvjp(fwd, bwd)
    return typed_kernel(*args)
