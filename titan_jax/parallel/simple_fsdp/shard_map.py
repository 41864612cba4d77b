"""SimpleFSDP's explicit twin: `jax.shard_map` over the data axes with `lax.all_gather`,
`lax.psum_scatter` and `lax.psum` written out. Model-parallel splits (tp, and ep for the
experts) are left to the partitioner or kept local; expert and context parallelism and the
Pallas kernels of MoE on TPU need its manual data axes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from titan_jax.models.quantization import PrequantizedWeight, WeightQuantization
from titan_jax.models.sharding_hooks import (
    GATHERED_PARAM,
    Kernel,
    LogicalAxes,
    LossAux,
    ParamTrees,
    PipelineSplit,
    SummedLoss,
    each_params_tree,
)
from titan_jax.models.spec import Params
from titan_jax.parallel.compiler_workarounds import cast_in_loop
from titan_jax.parallel.per_shard import manual_per_shard
from titan_jax.parallel.rules import WeightLayout
from titan_jax.parallel.simple_fsdp.base import SimpleFSDP, only_axes


# Hand-written VJP: the gradient is cast to reduce_dtype (fp32) before its reduce-scatter,
# where autodiff would reduce it in the compute dtype (a bf16 reduce-scatter XLA:CPU aborts on).
# Without it: tests/parallel/test_simple_fsdp.py::
# test_bf16_gathers_and_fp32_gradient_reductions[hsdp2x4-shard_map]
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def all_gather_param(
    shard: jax.Array,
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    gathered_dims: tuple[tuple[int, str], ...],
    replicated: tuple[str, ...],
) -> jax.Array:
    """Inside shard_map: this device's `shard` cast to `dtype`, marked varying over the data
    axes it is stored whole on (`replicated`) and all-gathered along `gathered_dims` ((dim,
    mesh axis) pairs). Splits a use keeps (experts over `ep`) stay local.

    Marking it varying here, not at the consumer, keeps that mark's implicit transpose (a psum
    in the cotangent's dtype, bf16) out of the backward, which reduces explicitly.
    """
    x = cast_in_loop(shard, dtype)
    if replicated:
        x = lax.pcast(x, replicated, to="varying")
    for dim, axis in gathered_dims:
        x = lax.all_gather(x, axis, axis=dim, tiled=True)
    return checkpoint_name(x, GATHERED_PARAM)


def _all_gather_param_fwd(
    shard: jax.Array,
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    gathered_dims: tuple[tuple[int, str], ...],
    replicated: tuple[str, ...],
) -> tuple[jax.Array, None]:
    return all_gather_param(shard, dtype, reduce_dtype, gathered_dims, replicated), None


def _all_gather_param_bwd(
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    gathered_dims: tuple[tuple[int, str], ...],
    replicated: tuple[str, ...],
    _: None,
    g: jax.Array,
) -> tuple[jax.Array]:
    return (_reduce_gradient(g, reduce_dtype, gathered_dims, replicated),)


def _reduce_gradient(
    g: jax.Array,
    reduce_dtype: jnp.dtype,
    gathered_dims: tuple[tuple[int, str], ...],
    replicated: tuple[str, ...],
) -> jax.Array:
    """A gathered weight's gradient `g`, cast to `reduce_dtype` and reduced to the shard."""
    g = g.astype(reduce_dtype)  # before any reduction
    for dim, axis in reversed(gathered_dims):
        g = lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)  # FSDP
    return lax.psum(g, replicated) if replicated else g  # DDP, and HSDP's replicas


all_gather_param.defvjp(_all_gather_param_fwd, _all_gather_param_bwd)


# Hand-written VJP: the gathered codes carry no gradient, so the port's cotangent is
# reduce-scattered in reduce_dtype to the shard. Without it:
# tests/parallel/test_quantized_gather.py::
# test_quantized_gathers_equal_quantizing_after_the_gather
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def all_gather_quantized(
    shard: jax.Array,
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    gathered_dims: tuple[tuple[int, str], ...],
    replicated: tuple[str, ...],
    quantized: WeightQuantization,
) -> PrequantizedWeight:
    """`all_gather_param` of a weight a quantized matmul reads: this device's `shard` cast
    to `dtype` and quantized with the whole weight's scales (a max over the axes splitting the
    dims each scale spans), then its codes (and the scales split along a gathered dim)
    all-gathered. The gradient the port receives is reduced as `all_gather_param`'s."""
    x = cast_in_loop(shard, dtype)
    if replicated:
        x = lax.pcast(x, replicated, to="varying")
    scaled = quantized.scaled_dims(x.ndim)
    spanned = tuple(axis for dim, axis in gathered_dims if dim not in scaled)
    codes = quantized.quantize(x, functools.partial(_max_over, axes=spanned))
    values, scale = codes.qvalue, codes.scale
    if spanned:  # typed as the codes it scales: a per-shard kernel types its inputs alike
        scale = lax.pcast(scale, spanned, to="varying")
    for dim, axis in gathered_dims:
        values = lax.all_gather(values, axis, axis=dim, tiled=True)
        if dim in scaled:
            scale = lax.all_gather(scale, axis, axis=dim, tiled=True)
    # `zeros_like` varies over the data axes as the codes do: the port's cotangent arrives
    # without an implicit (bf16) psum, reduced by the backward alone.
    port = jnp.zeros_like(values, dtype)
    return PrequantizedWeight(dataclasses.replace(codes, qvalue=values, scale=scale), port)


def _max_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`lax.pmax(x, axes)`, taken in fp32 (exact for a bf16 `x`): XLA:CPU aborts widening a
    bf16 max all-reduce ("Invalid binary instruction opcode copy"); the scales are small."""
    return lax.pmax(x.astype(jnp.float32), axes).astype(x.dtype) if axes else x


def _all_gather_quantized_fwd(
    shard: jax.Array,
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    gathered_dims: tuple[tuple[int, str], ...],
    replicated: tuple[str, ...],
    quantized: WeightQuantization,
) -> tuple[PrequantizedWeight, None]:
    args = (dtype, reduce_dtype, gathered_dims, replicated, quantized)
    return all_gather_quantized(shard, *args), None


def _all_gather_quantized_bwd(
    dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    gathered_dims: tuple[tuple[int, str], ...],
    replicated: tuple[str, ...],
    quantized: WeightQuantization,
    _: None,
    g: PrequantizedWeight,
) -> tuple[jax.Array]:
    return (_reduce_gradient(g.port, reduce_dtype, gathered_dims, replicated),)


all_gather_quantized.defvjp(_all_gather_quantized_fwd, _all_gather_quantized_bwd)


class ShardMapSimpleFSDP(SimpleFSDP):
    """SimpleFSDP with the collectives written out, manual over the data axes only."""

    implementation = "shard_map"
    reduces_in_bf16_on_cpu = False  # XLA:CPU aborts on a bf16 reduce-scatter ("opcode copy")
    # XLA's SPMD partitioner aborts on the 1F1B ticks beside tp here ("Check failed:
    # partition_group_list.num_replica_groups() * ..."); gpipe and the jit path compile.
    hosts_one_f_one_b_with_tp = False
    # A Mosaic kernel must see every mesh axis manual. GPipe's stages hold pp manual here (each
    # device its own stage, `models/pipeline.py`); the other schedules' stage dim leaves pp
    # automatic, where splash attention and megablox in a stage do not lower.
    tpu_kernel_pipeline_schedules = ("gpipe",)

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes `loss_map`'s shard_map holds manual: the data axes, and pp where the
        schedule runs its stages manually."""
        schedule = self.pipeline.schedule
        manual_pp = self.pipeline.degree > 1 and schedule in self.tpu_kernel_pipeline_schedules
        return self.data_axes + (("pp",) if manual_pp else ())

    def _gather(
        self,
        value: jax.Array,
        logical_axes: LogicalAxes,
        layout: WeightLayout,
        dtype: jnp.dtype,
        kept: bool,
    ) -> jax.Array:
        return all_gather_param(value, dtype, value.dtype, layout.gathered_dims, layout.replicated)

    def _gather_quantized(
        self,
        value: jax.Array,
        layout: WeightLayout,
        dtype: jnp.dtype,
        quantized: WeightQuantization,
    ) -> PrequantizedWeight:
        args = (dtype, value.dtype, layout.gathered_dims, layout.replicated, quantized)
        return all_gather_quantized(value, *args)

    def _gather_frozen(
        self, value: jax.Array, logical_axes: LogicalAxes, layout: WeightLayout, kept: bool
    ) -> jax.Array:
        if layout.replicated:  # typed as the trained weights it meets (`all_gather_param`)
            value = lax.pcast(value, layout.replicated, to="varying")
        for dim, axis in layout.gathered_dims:
            value = lax.all_gather(value, axis, axis=dim, tiled=True)
        return value

    def constrain(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        spec = self.rules.local_compute_spec("activation", logical_axes)
        return lax.with_sharding_constraint(x, spec) if spec else x  # data axes are manual

    def pipeline_split(self) -> PipelineSplit:
        if "pp" in self.manual_axes:
            return dataclasses.replace(self.pipeline, manual=True)
        # The stage vmap names no mesh axis: inside a shard_map an auto axis cannot be a vmap's
        # spmd_axis_name. Its stage dim is left unconstrained inside the stage, pinned to pp
        # between ticks (`models/pipeline.py`), and the partitioner keeps it there.
        return dataclasses.replace(self.pipeline, axis=None)

    def _vocab_shard_axes(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        return axes

    def run_per_shard(
        self,
        kernel: Kernel,
        args: tuple[jax.Array, ...],
        in_axes: tuple[LogicalAxes, ...],
        out_axes: LogicalAxes,
    ) -> jax.Array:
        in_specs, out_spec = self._local_specs(in_axes, out_axes)
        return manual_per_shard(kernel, args, in_specs, out_spec, self.manual_axes)

    def loss_map(self, summed_loss: SummedLoss) -> SummedLoss:
        data, manual = self.data_axes, self.manual_axes
        is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
        param_specs = jax.tree.map(
            lambda s: only_axes(s, manual), self.param_specs, is_leaf=is_spec
        )
        buffer_specs = jax.tree.map(
            lambda _: PartitionSpec(),
            self.buffer_specs,  # whole
            is_leaf=is_spec,
        )
        rows = self.rules.batch_spec  # rows, and under context parallelism sequence chunks

        def local(
            params: ParamTrees, buffers: Params, inputs: jax.Array, labels: jax.Array
        ) -> tuple[jax.Array, LossAux]:
            return jax.tree.map(
                lambda x: lax.psum(x, data), summed_loss(params, buffers, inputs, labels)
            )

        def mapped(
            params: ParamTrees, buffers: Params, inputs: jax.Array, labels: jax.Array
        ) -> tuple[jax.Array, LossAux]:
            specs = each_params_tree(params, lambda _: param_specs)
            return jax.shard_map(
                local,
                mesh=self.mesh,
                in_specs=(specs, buffer_specs, rows, rows),
                out_specs=PartitionSpec(),
                axis_names=frozenset(manual),
            )(params, buffers, inputs, labels)

        return mapped
