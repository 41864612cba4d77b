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
axes they really vary over. The forward is the kernel's own VJP's forward, its residuals
returned beside the output (each with a leading dim over the model axes the kernel is mapped
over, as a shard_map output needs); the backward applies the kernel's VJP to them. Both are
traced on untyped abstract values and evaluated on the typed ones. So the backward does not
compute the kernel's forward again (splash attention's forward, the experts' w1 and w3
grouped matmuls), as it did when only the inputs were saved. An input that is whole on every
shard of a model axis the kernel is mapped over (the experts' rows, under tp) gets its
cotangent summed over that axis: each shard's is a partial sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, PartitionSpec

Kernel = Callable[..., jax.Array]


def jit_per_shard(
    mesh: Mesh,
    kernel: Kernel,
    args: tuple[jax.Array, ...],
    in_specs: tuple[PartitionSpec, ...],
    out_spec: PartitionSpec,
) -> jax.Array:
    """The jit path: `kernel` under shard_map over the whole mesh. Called inside SimpleFSDP's
    vmap over data shards (spmd_axis_name = the data axes), whose batching rule adds the data
    axes to the shard dim: each device runs the kernel on its own rows."""
    return jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
        *args
    )


def manual_per_shard(
    kernel: Kernel,
    args: tuple[jax.Array, ...],
    in_specs: tuple[PartitionSpec, ...],
    out_spec: PartitionSpec,
    data_axes: tuple[str, ...],
) -> jax.Array:
    """The shard_map path: the data axes are already manual; a nested shard_map maps the
    model-parallel axes the specs name (none: the kernel sees this shard whole)."""

    def axes_of(spec: PartitionSpec) -> frozenset[str]:
        return frozenset(
            a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))
        )

    model_axes = frozenset().union(*map(axes_of, (*in_specs, out_spec)))
    # An input whole on each shard of a model axis (the experts' rows, whose hidden dim tp
    # splits) gets a partial cotangent from each: summed over those axes.
    summed_over = [tuple(sorted(model_axes - axes_of(spec))) for spec in in_specs]

    def unchecked(f: Kernel, specs: tuple[PartitionSpec, ...], out: object) -> Kernel:
        return jax.shard_map(
            f, in_specs=specs, out_specs=out, axis_names=model_axes, check_vma=False
        )

    def vary(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in data_axes if a not in jax.typeof(x).mat.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    residual_spec = PartitionSpec(tuple(sorted(model_axes)) or None)
    # The kernel VJP's structure, and for each of its leaves the kernel input it is (None: a
    # residual the forward returns), from the forward's trace. Inputs are not returned: a
    # shard_map output would copy them (the experts' rows and weights, each layer).
    pullback: list[Any] = []

    def untyped(f: Callable[..., Any], *xs: jax.Array) -> list[jax.Array]:
        """`f`'s flat outputs, traced on untyped abstract values, evaluated on `xs`."""
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]
        return jaxpr_as_fun(jax.make_jaxpr(f)(*abstract))(*xs)

    def forward(*xs: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        def traced(*a: jax.Array) -> list[jax.Array]:
            y, vjp = jax.vjp(kernel, *a)
            leaves, tree = jax.tree.flatten(vjp)
            position = {id(x): i for i, x in enumerate(a)}
            sources = [position.get(id(leaf)) for leaf in leaves]
            pullback[:] = [tree, sources]
            return [y, *(leaf for leaf, i in zip(leaves, sources, strict=True) if i is None)]

        y, *residuals = untyped(traced, *xs)
        return y, [r[None] for r in residuals]  # a leading dim over the model axes

    def backward(
        xs: tuple[jax.Array, ...], residuals: list[jax.Array], g: jax.Array
    ) -> tuple[jax.Array, ...]:
        tree, sources = pullback
        computed = iter(r[0] for r in residuals)
        leaves = [next(computed) if i is None else xs[i] for i in sources]

        def traced(g: jax.Array, *leaves: jax.Array) -> tuple[jax.Array, ...]:
            return jax.tree.unflatten(tree, leaves)(g)

        cts = untyped(traced, g, *leaves)
        return tuple(
            lax.psum(ct, axes) if axes and jnp.issubdtype(ct.dtype, jnp.inexact) else ct
            for ct, axes in zip(cts, summed_over, strict=True)
        )

    @jax.custom_vjp
    def typed_kernel(*xs: jax.Array) -> jax.Array:
        return vary(unchecked(kernel, in_specs, out_spec)(*xs))

    def fwd(*xs: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
        y, residuals = unchecked(forward, in_specs, (out_spec, residual_spec))(*xs)
        return vary(y), (xs, residuals)

    def bwd(saved: tuple[Any, ...], g: jax.Array) -> tuple[jax.Array, ...]:
        cts = unchecked(backward, (in_specs, residual_spec, out_spec), in_specs)(*saved, g)
        return tuple(vary(ct) for ct in cts)

    typed_kernel.defvjp(fwd, bwd)
    return typed_kernel(*args)
