"""What both SimpleFSDP implementations share: the mesh and table they read, the dtype
decisions of a weight read, the expert dispatch and the sequence split. Each implementation
says how a weight is gathered, an activation pinned, a kernel run per shard and the loss
mapped over data shards.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from titan_jax.models.quantization import PrequantizedWeight, WeightQuantization
from titan_jax.models.sharding_hooks import (
    ExpertFFN,
    Kernel,
    LogicalAxes,
    Parallelism,
    PipelineSplit,
    SequenceSplit,
    SummedLoss,
    VocabSplit,
)
from titan_jax.parallel.context_parallel import CP, ContextParallel
from titan_jax.parallel.expert_parallel import exchange_for, ragged_dispatch
from titan_jax.parallel.rules import ShardingRules, WeightLayout, mesh_axes_of
from titan_jax.parallel.vocab_parallel import VocabParallel


def only_axes(spec: PartitionSpec, keep: tuple[str, ...]) -> PartitionSpec:
    """`spec` restricted to the mesh axes in `keep` (replicated over the others)."""
    out = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n in keep)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


@dataclasses.dataclass(frozen=True)
class SimpleFSDP(Parallelism, abc.ABC):
    """SimpleFSDP on one mesh: the model's hooks (weight reads, activation layouts, the expert
    dispatch, per-shard kernels) and the `loss_map` around the step's summed loss.

    A weight's layout comes from its logical axes as used (`ShardingRules.weight_layout`).
    param_specs, buffer_specs: storage PartitionSpecs of the params and buffers (trees).
    reduce_dtype: dtype of gradient reductions (TorchTitan's `mixed_precision_reduce`; fp32 by
    default). cp_method: `parallelism.context_parallel_method`. ep_chunks:
    `parallelism.expert_parallel_chunks`. param_axes: the params' logical axes (tree), which the
    jit path needs to hand each shard its slice of the vocabulary tables. pipeline: the stacked
    layers' stages over the `pp` axis (`models/pipeline.py`; degree 1: none).
    """

    implementation = ""  # "jit" or "shard_map": the config's name of the subclass
    # What an implementation cannot host, read by the run's checks and the rules table (each
    # subclass that sets one False says why).
    reduces_in_bf16_on_cpu = True  # mixed_precision_reduce=bfloat16 on CPU devices
    hosts_splash_lookahead = True  # the look-ahead gather's scan around splash attention
    splits_vocab_across_replicas = True  # vocabulary tables split in compute under HSDP
    hosts_one_f_one_b_with_tp = True  # the 1F1B pipeline (models/one_f_one_b.py) beside tp
    # The pipeline schedules whose stages host Pallas TPU kernels (pp > 1): all on the jit path.
    tpu_kernel_pipeline_schedules: ClassVar[tuple[str, ...]] = ("gpipe", "interleaved", "1f1b")
    # A weight a quantized matmul reads, gathered as codes where its compute layout keeps a
    # data axis's split (the experts over ep), over the axes it gathers.
    quantizes_kept_splits = True

    rules: ShardingRules
    param_specs: Any
    buffer_specs: Any = dataclasses.field(default_factory=dict)
    reduce_dtype: Any = jnp.float32
    cp_method: str = "allgather"
    ep_chunks: int = 1
    param_axes: Any = None
    pipeline: PipelineSplit = PipelineSplit()

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.rules.mesh

    @property
    def data_axes(self) -> tuple[str, ...]:
        return self.rules.data_axes

    @property
    def n_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def ep(self) -> int:
        return self.mesh.shape.get("ep", 1)

    @property
    def cp(self) -> int:
        return self.mesh.shape.get(CP, 1)

    def use_param(self, value: jax.Array, logical_axes: LogicalAxes, dtype: jnp.dtype) -> jax.Array:
        """Cast to `dtype` and gathered from storage to compute layout; runs inside
        `loss_map`."""
        layout = self.rules.weight_layout(logical_axes)
        dtype, reduce_dtype = jnp.dtype(dtype), jnp.dtype(self.reduce_dtype)
        value = value.astype(reduce_dtype)  # its transpose widens the reduced gradient
        kept = bool(mesh_axes_of(layout.compute) & set(self.data_axes))
        if kept and "vocab" in logical_axes:
            # The vocabulary tables, kept split over the data shards: handed over as stored,
            # in the reduce dtype, without a compute-dtype copy; their users cast it chunk by
            # chunk and sum its gradient over chunks in that dtype (vocab_parallel.py). The
            # experts, kept split over ep, are cast like any weight: in the reduce dtype their
            # grouped matmuls, and the rows the exchange returns, would be fp32.
            dtype = reduce_dtype
        return self._gather(value, logical_axes, layout, dtype, kept)

    def use_quantized_param(
        self,
        value: jax.Array,
        logical_axes: LogicalAxes,
        dtype: jnp.dtype,
        quantized: WeightQuantization,
    ) -> PrequantizedWeight | None:
        """Cast to `dtype`, quantized on each shard with the whole weight's scales and
        gathered as codes and scales; its gradient reduced as `use_param`'s. None for a
        weight no data axis gathers (nothing to save), and for one whose compute layout
        keeps a data axis's split where the implementation does not quantize such a weight
        (`quantizes_kept_splits`)."""
        layout = self.rules.weight_layout(logical_axes)
        kept = bool(mesh_axes_of(layout.compute) & set(self.data_axes))
        if not layout.gathered_dims or (kept and not self.quantizes_kept_splits):
            return None
        value = value.astype(self.reduce_dtype)  # its transpose widens the reduced gradient
        return self._gather_quantized(value, layout, jnp.dtype(dtype), quantized)

    @abc.abstractmethod
    def _gather_quantized(
        self,
        value: jax.Array,
        layout: WeightLayout,
        dtype: jnp.dtype,
        quantized: WeightQuantization,
    ) -> PrequantizedWeight:
        """`value` (in the reduce dtype) cast to `dtype`, quantized where it is stored as
        `quantized` says with the whole weight's scales, gathered to `layout.compute`."""

    def gather_frozen(self, value: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        """A frozen weight (no gradient) gathered in its stored dtype: the collective moves
        the stored bytes (bf16, or int8/fp8/nf4 codes), the cast or dequantize runs after."""
        layout = self.rules.weight_layout(logical_axes)
        kept = bool(mesh_axes_of(layout.compute) & set(self.data_axes))
        return self._gather_frozen(value, logical_axes, layout, kept)

    @abc.abstractmethod
    def _gather_frozen(
        self, value: jax.Array, logical_axes: LogicalAxes, layout: WeightLayout, kept: bool
    ) -> jax.Array:
        """`value` gathered to `layout.compute` as it is (no cast, no backward rule)."""

    @abc.abstractmethod
    def _gather(
        self,
        value: jax.Array,
        logical_axes: LogicalAxes,
        layout: WeightLayout,
        dtype: jnp.dtype,
        kept: bool,
    ) -> jax.Array:
        """`value` (in the reduce dtype) cast to `dtype` and gathered to `layout.compute`;
        `kept`: the compute layout keeps a data-parallel split (vocabulary, experts)."""

    def dispatch_to_experts(
        self,
        rows_MD: jax.Array,
        experts_M: jax.Array,
        gates_M: jax.Array,
        n_local: int,
        ffn: ExpertFFN,
    ) -> jax.Array:
        """Under expert parallelism the picks travel to their expert's rank and back by the
        target devices' ragged all-to-all (`parallel/expert_parallel.py`: emulated on CPU);
        otherwise every expert is local."""
        if self.ep == 1:
            return super().dispatch_to_experts(rows_MD, experts_M, gates_M, n_local, ffn)
        exchange = exchange_for(
            self.mesh.devices.flat[0].platform, rows_MD.shape[0] // self.ep_chunks
        )
        return ragged_dispatch(
            rows_MD, experts_M, gates_M, n_local, ffn, "ep", self.ep, exchange, self.ep_chunks
        )

    def vocab_split(self) -> VocabSplit:
        """The vocabulary tables' split over the data axes (`parallel/vocab_parallel.py`),
        named as the implementation names its data shards."""
        axes = self.rules.vocab_data_axes
        if not axes:
            return super().vocab_split()
        degree = math.prod(self.mesh.shape[a] for a in axes)
        return VocabParallel(self._vocab_shard_axes(axes), degree)

    @abc.abstractmethod
    def _vocab_shard_axes(self, axes: tuple[str, ...]) -> str | tuple[str, ...]:
        """The axis name(s) the vocabulary's data shards go by inside `loss_map`."""

    def pipeline_split(self) -> PipelineSplit:
        return self.pipeline

    def sequence_split(self) -> SequenceSplit:
        """Under context parallelism each rank holds two chunks of every sequence and gathers
        K/V over `cp` or passes them around it (`parallel/context_parallel.py`)."""
        if self.cp == 1:
            return super().sequence_split()
        return ContextParallel(self.cp, self.cp_method)

    def _local_specs(
        self, in_axes: tuple[LogicalAxes, ...], out_axes: LogicalAxes
    ) -> tuple[tuple[PartitionSpec, ...], PartitionSpec]:
        """A per-shard kernel's specs: the table's model-parallel part of the activations'
        layout (the data axes are the per-shard map's)."""
        local = lambda axes: self.rules.local_compute_spec("activation", axes)  # noqa: E731
        return tuple(local(axes) for axes in in_axes), local(out_axes)

    def split_degree(self, logical_axis: str) -> int:
        spec = self.rules.local_compute_spec("activation", (logical_axis,))
        return math.prod(self.mesh.shape[a] for a in mesh_axes_of(spec))

    @abc.abstractmethod
    def constrain(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        """Pins an activation of one data shard to its model-parallel layout from the table
        (nothing to pin without a model-parallel axis)."""

    @abc.abstractmethod
    def run_per_shard(
        self,
        kernel: Kernel,
        args: tuple[jax.Array, ...],
        in_axes: tuple[LogicalAxes, ...],
        out_axes: LogicalAxes,
    ) -> jax.Array:
        """A kernel GSPMD cannot partition (Pallas), run on each device's own rows and heads
        (`parallel/per_shard.py`). Runs inside `loss_map`."""

    @abc.abstractmethod
    def loss_map(self, summed_loss: SummedLoss) -> SummedLoss:
        """The step's summed loss (and aux), computed per data shard and summed over shards."""
