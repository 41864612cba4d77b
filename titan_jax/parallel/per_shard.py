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
axes they really vary over. The forward is JAX's VJP of the unchecked shard_map, and its
pullback (a pytree of residuals) is the custom_vjp's residual: the backward applies it, so it
does not compute the kernel's forward again (splash attention's forward, the experts' w1 and
w3 grouped matmuls), and shard_map's own partial evaluation decides which residuals are inputs
(not copied) and how the others leave the nested map. Both are traced on untyped abstract
values and evaluated on the typed ones. shard_map's transpose sums the cotangent of an input
that is whole on every shard of a model axis the kernel is mapped over (the experts' rows,
under tp) over that axis: each shard's is a partial sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
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

    mesh = jax.sharding.get_abstract_mesh()
    # Axes of size 1 no spec names (pp without a pipeline) join the map too: a Mosaic kernel
    # needs every mesh axis manual.
    unit_axes = frozenset(a for a, n in mesh.shape.items() if n == 1) - set(mesh.manual_axes)
    model_axes = frozenset().union(*map(axes_of, (*in_specs, out_spec)), unit_axes)
    mapped = jax.shard_map(
        kernel, in_specs=in_specs, out_specs=out_spec, axis_names=model_axes, check_vma=False
    )

    def vary(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in data_axes if a not in jax.typeof(x).mat.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    # Hand-written VJP: autodiff of the unchecked shard_map returns untyped cotangents for the
    # typed (varying) inputs, which the checked outer shard_map refuses. Without it:
    # tests/parallel/test_per_shard.py::
    # test_a_per_shard_kernel_over_a_model_axis_equals_the_plain_kernel_forward_once
    @jax.custom_vjp
    def typed_kernel(*xs: jax.Array) -> jax.Array:
        return vary(mapped(*xs))

    def fwd(*xs: jax.Array) -> tuple[jax.Array, Any]:
        y, pullback = untyped(lambda *a: jax.vjp(mapped, *a), *xs)
        return vary(y), pullback  # the pullback (a pytree of residuals) is the residual

    def bwd(pullback: Any, g: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(map(vary, untyped(lambda pull, g: pull(g), pullback, g)))

    typed_kernel.defvjp(fwd, bwd)
    return typed_kernel(*args)


def untyped[T](f: Callable[..., T], *xs: Any) -> T:
    """`f(*xs)` traced on untyped abstract values (no varying axes) and evaluated on `xs`: the
    kernel and its VJP are typed as the unchecked shard_map's values, not as the data axes'."""
    leaves, tree = jax.tree.flatten(xs)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    closed, out_shape = jax.make_jaxpr(
        lambda *leaves: f(*jax.tree.unflatten(tree, leaves)), return_shape=True
    )(*abstract)
    return jax.tree.unflatten(jax.tree.structure(out_shape), jaxpr_as_fun(closed)(*leaves))
