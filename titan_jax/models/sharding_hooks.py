"""Where parallelism meets a model: one plug-in object, `Parallelism`, with one name per hook.

A model calls four functions, naming dimensions by logical axis only (`("batch", "seq",
"embed")`), and the active `Parallelism` answers each under the same name:
- `use_param(param, dtype, quantized)`: the weight as the forward uses it (a `FrozenParam`, a
  LoRA model's frozen base, through `gather_frozen`: gathered as stored, then cast; a weight a
  quantized matmul reads, through `use_quantized_param`: gathered as its codes where the
  hooks gather it);
- `constrain(x, logical_axes)`: an activation pinned to its layout;
- `dispatch_to_experts(rows, experts, gates, n_local, ffn)`: MoE picks through their
  experts' FFN, each output scaled by its gate weight;
- `run_per_shard(kernel, args, in_axes, out_axes)`: a kernel the compiler cannot partition
  (Pallas), run on each device's shard;
- `sequence_split()`: where this shard's tokens sit in the sequence, for RoPE and attention
  (context parallelism splits it);
- `vocab_split()`: how the vocabulary tables are split (the embedding lookup and the loss read
  only their shard's vocabulary slice and exchange tokens, never the whole table);
- `pipeline_split()`: how the stacked layers are split into pipeline stages (the layer scan
  becomes a schedule over stages and microbatches: `titan_jax/models/pipeline.py`).
The step adds a fifth, `loss_map`, around the summed loss (how the batch's computation is
split). The base class is no parallelism: a weight read is a cast to the compute dtype, a
constraint does nothing, every expert is local, a kernel sees the whole arrays, the whole
sequence is here and the loss is one computation. SimpleFSDP
(`titan_jax/parallel/simple_fsdp/`) overrides them from the one rules table; the step
installs it (`installed()`) around its whole trace, so the hooks are active in custom_vjp
backward rules too (they run after the forward has returned). So the
model never knows the mesh.

Gathered weights carry the checkpoint name `GATHERED_PARAM`; that name alone is how remat
policies find them (`titan_jax/models/remat.py`). A layer scan may gather a layer's weights ahead
of its use (`gather_layer`, the look-ahead gather of `titan_jax/models/lookahead.py`); the layer
then runs under `pregathered()`, where `use_param` hands them back as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, overload

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from titan_jax.models.spec import Params

if TYPE_CHECKING:
    from titan_jax.models.quantization import PrequantizedWeight, WeightQuantization

LogicalAxes = tuple[str | None, ...]
# checkpoint_name of every weight as the forward uses it (cast, and gathered under FSDP).
GATHERED_PARAM = "fsdp_gathered_param"
# (rows (M, D), local expert id of each row (M,), gate weight of each row (M,)) -> each row
# through its expert's FFN, scaled by its gate weight (M, D).
ExpertFFN = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
Kernel = Callable[..., jax.Array]
# The model's params tree, or a tuple of such trees (a policy and its frozen reference,
# train/dpo.py): `loss_map` hands each to the shards as it hands one.
ParamTrees = Params | tuple[Params, ...]
LossAux = Any  # what a summed loss returns beside it: a tree of arrays, summed like the loss
# A batch's summed loss and its aux, (params, buffers, inputs_BT, labels_BT) -> (scalar, aux).
SummedLoss = Callable[[ParamTrees, Params, jax.Array, jax.Array], tuple[jax.Array, LossAux]]


def each_params_tree(params: ParamTrees, f: Callable) -> Any:
    """`f` of the params tree, or the tuple of `f` of each of several (see SummedLoss)."""
    return tuple(f(p) for p in params) if isinstance(params, tuple) else f(params)


class SequenceSplit(Protocol):
    """How each sequence is split over devices (context parallelism). A forward sees its shard's
    tokens: `positions(t)` are their global positions (t = the local length), `gather(x)` the
    whole sequence of a (B, t, ...) activation (K/V) along dim 1, whose tokens sit at
    `gathered_positions(t)`; `in_position_order` reorders such a gathered array by position.
    Under degree > 1 a shard holds two of the 2 x degree equal chunks, `chunks()` their
    indices. `degree` 1: the whole sequence is here. `method`: how attention sees the other
    shards' K/V, "allgather" (`gather`) or "ring" (`pass_along`: each shard's block to the
    next shard, degree - 1 times)."""

    @property
    def degree(self) -> int: ...
    @property
    def method(self) -> str: ...

    def positions(self, t_local: int) -> jax.Array: ...

    def gathered_positions(self, t_local: int) -> jax.Array: ...

    def gather(self, x: jax.Array) -> jax.Array: ...

    def in_position_order(self, x: jax.Array) -> jax.Array: ...

    def chunks(self) -> jax.Array: ...

    def pass_along(self, x: jax.Array) -> jax.Array: ...


class VocabSplit(Protocol):
    """How the vocabulary dimension of the embedding and output projection is split over the
    data shards. Each shard holds one contiguous slice of the vocabulary (starting at
    `offset(v_local)`) and, per call, its own tokens: `gather(x)` stacks every shard's rows of
    `x` along dim 0 (shard-major), `scatter_sum(x)` sums such a stacked array over shards and
    keeps this shard's rows, `own(x)` picks this shard's rows of it without summing,
    `sum`/`max` reduce elementwise over shards. `degree` 1: the whole vocabulary is here."""

    @property
    def degree(self) -> int: ...

    def offset(self, v_local: int) -> jax.Array: ...

    def gather(self, x: jax.Array) -> jax.Array: ...

    def scatter_sum(self, x: jax.Array) -> jax.Array: ...

    def own(self, x: jax.Array) -> jax.Array: ...

    def sum(self, x: jax.Array) -> jax.Array: ...

    def max(self, x: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class WholeVocab:
    degree: int = 1

    def offset(self, v_local: int) -> jax.Array:
        return jnp.zeros((), jnp.int32)

    def gather(self, x: jax.Array) -> jax.Array:
        return x

    scatter_sum = own = sum = max = gather


@dataclasses.dataclass(frozen=True)
class WholeSequence:
    degree: int = 1
    method: str = "allgather"

    def positions(self, t_local: int) -> jax.Array:
        return jnp.arange(t_local)

    def gathered_positions(self, t_local: int) -> jax.Array:
        return jnp.arange(t_local)

    def gather(self, x: jax.Array) -> jax.Array:
        return x

    def in_position_order(self, x: jax.Array) -> jax.Array:
        return x

    def chunks(self) -> jax.Array:
        return jnp.zeros((1,), jnp.int32)

    def pass_along(self, x: jax.Array) -> jax.Array:
        return x


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """How the stacked layers run as a pipeline (`titan_jax/models/pipeline.py`): `degree`
    stages, each holding `virtual` chunks of consecutive layers (chunk c on stage c mod degree:
    the circular, or interleaved, placement), fed `microbatches` slices of the batch. `axis`:
    the mesh axis the stage dim is split over (None: no mesh). `degree` 1: one layer scan.
    `schedule`: "gpipe" or "interleaved" (backward is autodiff's: every forward tick first), or
    "1f1b" (`titan_jax/models/one_f_one_b.py`: forward and backward alternate, the loss inside
    the pipeline). `manual`: `axis` is manual where the pipeline runs (a shard_map over it):
    each device runs its own stage and hands its output on by `ppermute`, instead of a stage
    dim that the partitioner splits."""

    degree: int = 1
    virtual: int = 1
    microbatches: int = 1
    axis: str | None = None
    schedule: str = "gpipe"
    manual: bool = False


class Parallelism:
    """No parallelism; subclasses override the hooks they change (see the module docstring)."""

    def use_param(self, value: jax.Array, logical_axes: LogicalAxes, dtype: jnp.dtype) -> jax.Array:
        """(stored value as used, its logical axes, compute dtype) -> the weight the forward
        uses. Inside the layer scan the value is one layer's slice and its axes lack `layers`."""
        del logical_axes
        return value.astype(dtype)

    def use_quantized_param(
        self,
        value: jax.Array,
        logical_axes: LogicalAxes,
        dtype: jnp.dtype,
        quantized: WeightQuantization,
    ) -> PrequantizedWeight | None:
        """The weight a quantized matmul reads, quantized as `quantized` says before it is
        gathered (the gather then moves its codes); None where nothing gathers it: the
        matmul quantizes `use_param`'s weight itself."""
        del value, logical_axes, dtype, quantized
        return None

    def gather_frozen(self, value: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        """A weight that never trains (no gradient, nothing to reduce) from storage to its
        compute layout, in the dtype it is stored in (quantized codes stay codes)."""
        del logical_axes
        return value

    def constrain(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        del logical_axes
        return x

    def dispatch_to_experts(
        self,
        rows_MD: jax.Array,
        experts_M: jax.Array,
        gates_M: jax.Array,
        n_local: int,
        ffn: ExpertFFN,
    ) -> jax.Array:
        """Each row (one (token, slot) pick) through the FFN of its expert (`experts_M`, global
        ids) with its gate weight (`gates_M`), in the rows' order. `ffn` holds the `n_local`
        experts kept here; every expert is here without expert parallelism."""
        del n_local
        return ffn(rows_MD, experts_M, gates_M)

    def run_per_shard(
        self,
        kernel: Kernel,
        args: tuple[jax.Array, ...],
        in_axes: tuple[LogicalAxes, ...],
        out_axes: LogicalAxes,
    ) -> jax.Array:
        """`kernel(*args)` run on each device's own shard of `args` (as the rules table splits
        `in_axes`), the shards' outputs (`out_axes`) forming the result."""
        del in_axes, out_axes
        return kernel(*args)

    def split_degree(self, logical_axis: str) -> int:
        """How many ways a per-shard kernel's arguments are split on `logical_axis` (the
        model-parallel splits the rules table gives it: e.g. the heads over tp)."""
        del logical_axis
        return 1

    def sequence_split(self) -> SequenceSplit:
        """How each sequence is split over devices (see SequenceSplit)."""
        return WholeSequence()

    def vocab_split(self) -> VocabSplit:
        """How the vocabulary tables are split over devices (see VocabSplit)."""
        return WholeVocab()

    def pipeline_split(self) -> PipelineSplit:
        """How the stacked layers are split into pipeline stages (see PipelineSplit)."""
        return PipelineSplit()

    def loss_map(self, summed_loss: SummedLoss) -> SummedLoss:
        """A transform of the summed loss, applied before it is differentiated."""
        return summed_loss

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """These hooks answer the model's calls for the duration (of a trace)."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


@dataclasses.dataclass(frozen=True)
class _Pregathered(Parallelism):
    """`outer`'s hooks, but weights come as they are: `gather_layer` already gathered them."""

    outer: Parallelism

    def use_param(self, value: jax.Array, logical_axes: LogicalAxes, dtype: jnp.dtype) -> jax.Array:
        if value.dtype != jnp.dtype(dtype):  # `gather_layer` read it at another dtype
            raise ValueError(
                f"a weight gathered ahead in {value.dtype} is used in "
                f"{jnp.dtype(dtype)}; gather it in the dtype its layer uses"
            )
        return value

    def gather_frozen(self, value: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        return value

    def constrain(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        return self.outer.constrain(x, logical_axes)

    def dispatch_to_experts(
        self,
        rows_MD: jax.Array,
        experts_M: jax.Array,
        gates_M: jax.Array,
        n_local: int,
        ffn: ExpertFFN,
    ) -> jax.Array:
        return self.outer.dispatch_to_experts(rows_MD, experts_M, gates_M, n_local, ffn)

    def run_per_shard(
        self,
        kernel: Kernel,
        args: tuple[jax.Array, ...],
        in_axes: tuple[LogicalAxes, ...],
        out_axes: LogicalAxes,
    ) -> jax.Array:
        return self.outer.run_per_shard(kernel, args, in_axes, out_axes)

    def split_degree(self, logical_axis: str) -> int:
        return self.outer.split_degree(logical_axis)

    def sequence_split(self) -> SequenceSplit:
        return self.outer.sequence_split()

    def vocab_split(self) -> VocabSplit:
        return self.outer.vocab_split()

    def pipeline_split(self) -> PipelineSplit:
        return self.outer.pipeline_split()

    def loss_map(self, summed_loss: SummedLoss) -> SummedLoss:
        return self.outer.loss_map(summed_loss)


NO_PARALLELISM = Parallelism()  # one device, or a trace without a mesh
_ACTIVE: contextvars.ContextVar[Parallelism] = contextvars.ContextVar(
    "parallelism", default=NO_PARALLELISM
)


class FrozenParam(nnx.Param):
    """A weight that never trains, kept in the dtype it is stored in (a LoRA model's frozen
    base in bf16, or a quantized weight's codes and scales: `models/frozen_weights.py`)."""


class WeightInParts(Protocol):
    """A weight stored as several arrays (a quantized weight's codes and scales), which reads
    its parts with `gather_frozen` and makes the weight from them."""

    def dequantized(self, dtype: jnp.dtype) -> jax.Array: ...


@overload
def use_param(
    param: nnx.Variable | WeightInParts, dtype: DTypeLike, quantized: None = None
) -> jax.Array: ...
@overload
def use_param(
    param: nnx.Variable | WeightInParts, dtype: DTypeLike, quantized: WeightQuantization
) -> jax.Array | PrequantizedWeight: ...
def use_param(
    param: nnx.Variable | WeightInParts,
    dtype: DTypeLike,
    quantized: WeightQuantization | None = None,
) -> jax.Array | PrequantizedWeight:
    """The weight as the forward should see it (cast, and gathered when a mesh is active).
    A frozen weight is gathered in the dtype it is stored in and cast (or dequantized) after
    the gather, so the gather moves its stored bytes. A trained weight that a quantized matmul
    reads (`quantized`) comes quantized where the hooks gather it, so the gather moves codes."""
    dtype = jnp.dtype(dtype)
    if not isinstance(param, nnx.Variable):
        return checkpoint_name(param.dequantized(dtype), GATHERED_PARAM)
    if isinstance(param, FrozenParam):
        return checkpoint_name(gather_frozen(param).astype(dtype), GATHERED_PARAM)
    value, axes, hooks = param[...], _axes_of(param), _ACTIVE.get()
    if quantized is not None:
        codes = hooks.use_quantized_param(value, axes, dtype, quantized)
        if codes is not None:
            return checkpoint_name(codes, GATHERED_PARAM)
    return checkpoint_name(hooks.use_param(value, axes, dtype), GATHERED_PARAM)


def gather_frozen(param: FrozenParam) -> jax.Array:
    """A frozen param as stored (its own dtype), gathered to its compute layout."""
    return _ACTIVE.get().gather_frozen(param[...], _axes_of(param))


def _axes_of(param: nnx.Variable) -> LogicalAxes:
    axes = tuple(param.logical_axes)
    if len(axes) != param[...].ndim:
        raise ValueError(
            f"a weight of shape {param[...].shape} is used with logical axes "
            f"{axes}; a stacked weight is used one layer at a time, inside the "
            "layer scan"
        )
    return axes


def gather_layer(layer: nnx.State, dtype: jnp.dtype) -> nnx.State:
    """Every weight of one layer (a slice of the stacked layers' state) as `use_param` would
    hand it to the forward in `dtype` (or in the `read_dtype` its metadata names, as the MoE
    router's fp32): cast, and gathered when a mesh is active."""
    hooks = _ACTIVE.get()

    def gather(v: nnx.Variable) -> nnx.Variable:
        if isinstance(v, FrozenParam):  # cast (or dequantized) at use
            return v.replace(hooks.gather_frozen(v[...], tuple(v.logical_axes)))
        read_dtype = v.get_metadata().get("read_dtype", dtype)
        return v.replace(hooks.use_param(v[...], tuple(v.logical_axes), read_dtype))

    return jax.tree.map(gather, layer, is_leaf=lambda x: isinstance(x, nnx.Variable))


@contextlib.contextmanager
def pregathered() -> Iterator[None]:
    """For the duration (of a layer's trace) `use_param` returns each weight as it is: the
    layer's state holds weights `gather_layer` already gathered."""
    with _Pregathered(_ACTIVE.get()).installed():
        yield


def sequence_split() -> SequenceSplit:
    """How the sequences of the running forward are split (see SequenceSplit)."""
    return _ACTIVE.get().sequence_split()


def vocab_split() -> VocabSplit:
    """How the running forward's vocabulary tables are split (see VocabSplit)."""
    return _ACTIVE.get().vocab_split()


def pipeline_split() -> PipelineSplit:
    """How the running forward's stacked layers are split into stages (see PipelineSplit)."""
    return _ACTIVE.get().pipeline_split()


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """`x` pinned to the layout the rules table gives `logical_axes` (one name per dim)."""
    if len(logical_axes) != x.ndim:
        raise ValueError(f"logical axes {logical_axes} do not match shape {x.shape}")
    return _ACTIVE.get().constrain(x, logical_axes)


def dispatch_to_experts(
    rows_MD: jax.Array, experts_M: jax.Array, gates_M: jax.Array, n_local: int, ffn: ExpertFFN
) -> jax.Array:
    """The MoE layer's picks through their experts (see `Parallelism.dispatch_to_experts`)."""
    return _ACTIVE.get().dispatch_to_experts(rows_MD, experts_M, gates_M, n_local, ffn)


def split_degree(logical_axis: str) -> int:
    """How many ways a per-shard kernel's arguments are split on `logical_axis`."""
    return _ACTIVE.get().split_degree(logical_axis)


def run_per_shard(
    kernel: Kernel,
    args: tuple[jax.Array, ...],
    in_axes: tuple[LogicalAxes, ...],
    out_axes: LogicalAxes,
) -> jax.Array:
    """`kernel(*args)` on each device's shard (see `Parallelism.run_per_shard`): for a kernel
    that works on any slice of the split axes (rows, heads) but that the compiler cannot split."""
    return _ACTIVE.get().run_per_shard(kernel, args, in_axes, out_axes)
