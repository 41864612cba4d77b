"""The two places where parallelism meets a model: weight reads and activation layouts.

Every module reads its weights through `use_param` and pins the layout of the few activations
that matter through `constrain`, naming dimensions by logical axis only (`("batch", "seq",
"embed")`); an MoE layer sends its routed tokens through `dispatch_to_experts`, a kernel
the compiler cannot partition (Pallas) runs through `run_per_shard`, and RoPE and attention
ask `sequence_split` where their tokens sit in the sequence (context parallelism). By default a
weight read is a cast to the compute dtype, a constraint does nothing, every expert is local, a
kernel sees the whole arrays and the whole sequence is here. Parallelism installs
`ShardingHooks` for the duration of a trace (`sharding_hooks`): SimpleFSDP's cast + all-gather,
whose backward reduces the gradient in fp32, sharding constraints derived from the one rules
table (`titan_jax/parallel/rules.py`), kernels under shard_map, and context parallelism's
positions and K/V gathers. So the model never knows the mesh.

Gathered weights carry the checkpoint name `GATHERED_PARAM`; that name alone is how remat
policies find them (`is_gathered_param`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

LogicalAxes = tuple[str | None, ...]
# checkpoint_name of every weight as the forward uses it (cast, and gathered under FSDP).
GATHERED_PARAM = "fsdp_gathered_param"


class ParamUse(Protocol):
    """(stored value, its dotted path in the params tree, its logical axes, compute dtype) ->
    the weight the forward uses. Inside a layer scan the value is one layer's slice."""

    def __call__(self, value: jax.Array, path: str, logical_axes: LogicalAxes,
                 dtype: jnp.dtype) -> jax.Array: ...


class ActivationUse(Protocol):
    def __call__(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array: ...


# (rows (M, D), local expert id of each row (M,)) -> each row through its expert's FFN (M, D).
ExpertFFN = Callable[[jax.Array, jax.Array], jax.Array]


class ExpertDispatch(Protocol):
    """Routes each (token, slot) pick to the rank holding its expert and combines the results:
    (x (N, D), chosen experts (N, K), gate weights (N, K), experts held here, the FFN of the
    experts held here) -> sum_k weights * FFN_{expert}(x), (N, D)."""

    def __call__(self, x_ND: jax.Array, experts_NK: jax.Array, weights_NK: jax.Array,
                 n_local: int, ffn: ExpertFFN) -> jax.Array: ...


class PerShard(Protocol):
    """(kernel, its array arguments, their logical axes, the output's logical axes) -> the
    kernel run on each device's own shard of the arguments (as the rules table splits those
    axes), the shards' outputs forming the result. For kernels GSPMD cannot partition."""

    def __call__(self, kernel: Callable[..., jax.Array], args: tuple[jax.Array, ...],
                 in_axes: tuple[LogicalAxes, ...], out_axes: LogicalAxes) -> jax.Array: ...


class SequenceSplit(Protocol):
    """How each sequence is split over devices (context parallelism). A forward sees its shard's
    tokens: `positions(t)` are their global positions (t = the local length), `gather(x)` the
    whole sequence of a (B, t, ...) activation (K/V) along dim 1, whose tokens sit at
    `gathered_positions(t)`; `in_position_order` reorders such a gathered array by position.
    Under degree > 1 a shard holds two of the 2 x degree equal chunks, `chunks()` their
    indices. `degree` 1: the whole sequence is here."""

    degree: int

    def positions(self, t_local: int) -> jax.Array: ...

    def gathered_positions(self, t_local: int) -> jax.Array: ...

    def gather(self, x: jax.Array) -> jax.Array: ...

    def in_position_order(self, x: jax.Array) -> jax.Array: ...

    def chunks(self) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class WholeSequence:
    degree: int = 1

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


def local_dispatch(x_ND: jax.Array, experts_NK: jax.Array, weights_NK: jax.Array,
                   n_local: int, ffn: ExpertFFN) -> jax.Array:
    """Every expert is here: each pick's row through its expert, summed over the k slots in
    fp32, weighted by the gate."""
    del n_local
    n, k = experts_NK.shape
    y_NKD = ffn(x_ND[jnp.arange(n * k) // k], experts_NK.reshape(-1)).reshape(n, k, -1)
    return jnp.einsum("nk,nkd->nd", weights_NK, y_NKD.astype(jnp.float32)).astype(x_ND.dtype)


def cast_param(value: jax.Array, path: str, logical_axes: LogicalAxes,
               dtype: jnp.dtype) -> jax.Array:
    del path, logical_axes
    return value.astype(dtype)


def unconstrained(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    del logical_axes
    return x


def whole_arrays(kernel: Callable[..., jax.Array], args: tuple[jax.Array, ...],
                 in_axes: tuple[LogicalAxes, ...], out_axes: LogicalAxes) -> jax.Array:
    del in_axes, out_axes
    return kernel(*args)


@dataclasses.dataclass(frozen=True)
class ShardingHooks:
    param: ParamUse = cast_param
    activation: ActivationUse = unconstrained
    experts: ExpertDispatch = local_dispatch  # expert parallelism swaps in an all-to-all
    per_shard: PerShard = whole_arrays  # a mesh runs the kernel under shard_map
    sequence: SequenceSplit = WholeSequence()  # context parallelism splits it


NO_SHARDING = ShardingHooks()  # one device, or a trace without a mesh
_ACTIVE: contextvars.ContextVar[ShardingHooks] = contextvars.ContextVar(
    "sharding_hooks", default=NO_SHARDING)


@contextlib.contextmanager
def sharding_hooks(hooks: ShardingHooks) -> Iterator[None]:
    token = _ACTIVE.set(hooks)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# Variable metadata key holding a parameter's dotted path (set when a model is built), so that
# parallelism looks up the layout it computed once for that path.
PATH_METADATA = "param_path"


def use_param(param: nnx.Param, dtype: jnp.dtype) -> jax.Array:
    """The weight as the forward should see it (cast, and gathered when a mesh is active)."""
    path = param.get_metadata().get(PATH_METADATA, "")
    value = _ACTIVE.get().param(param[...], path, param.logical_axes, dtype)
    return checkpoint_name(value, GATHERED_PARAM)


def dispatch_to_experts(x_ND: jax.Array, experts_NK: jax.Array, weights_NK: jax.Array,
                        n_local: int, ffn: ExpertFFN) -> jax.Array:
    """The MoE layer's routed experts, through the active expert dispatch (see ExpertDispatch)."""
    return _ACTIVE.get().experts(x_ND, experts_NK, weights_NK, n_local, ffn)


def run_per_shard(kernel: Callable[..., jax.Array], args: tuple[jax.Array, ...],
                  in_axes: tuple[LogicalAxes, ...], out_axes: LogicalAxes) -> jax.Array:
    """`kernel(*args)` run on each device's shard of `args` (see PerShard): for a kernel that
    works on any slice of the split axes (rows, heads) but that the compiler cannot split."""
    return _ACTIVE.get().per_shard(kernel, args, in_axes, out_axes)


def sequence_split() -> SequenceSplit:
    """How the sequences of the running forward are split (see SequenceSplit)."""
    return _ACTIVE.get().sequence


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """`x` pinned to the layout the rules table gives `logical_axes` (one name per dim)."""
    if len(logical_axes) != x.ndim:
        raise ValueError(f"logical axes {logical_axes} do not match shape {x.shape}")
    return _ACTIVE.get().activation(x, logical_axes)


def is_gathered_param(prim: Any, params: dict[str, Any]) -> bool:
    """Whether an equation (as a remat policy sees it) yields a gathered weight, by name only.

    A gather that is a custom_vjp (its backward casts the gradient to fp32 before reducing it)
    reaches the policy as one opaque `custom_vjp_call`, so its body is searched for the name;
    other custom_vjps (kernels, permutes) are left alone.
    """
    if prim.name == "name":
        return params["name"] == GATHERED_PARAM
    body = params.get("call_jaxpr")
    if body is None:
        return False
    return any(e.primitive.name == "name" and e.params.get("name") == GATHERED_PARAM
               for e in getattr(body, "jaxpr", body).eqns)


def save_anything_except_gathered_params(prim: Any, *_: Any, **params: Any) -> bool:
    """Remat policy: save every value except the gathered weights (reshard_after_forward).

    What is saved instead is the gather's input, this device's shard; backward gathers again.
    Reshapes are not saved either: they are free to redo, and a reshaped gathered weight (a
    kernel's 2-D view of it) would otherwise be kept in the weight's place.
    """
    return prim.name != "reshape" and not is_gathered_param(prim, params)
