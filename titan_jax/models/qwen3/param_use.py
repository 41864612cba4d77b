"""The one place a stored parameter becomes a compute weight.

Every module reads its weights through `use_param`. By default that is a cast to the compute
dtype. Parallelism installs a `ParamUse` (e.g. SimpleFSDP's cast + all-gather, whose backward
reduces the gradient in fp32) for the duration of a trace with `param_use_context`, so the model
itself never knows the mesh, only each weight's logical axis names.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

# checkpoint_name of every gathered weight: remat policies save or recompute it by this name.
GATHERED_PARAM = "fsdp_gathered_param"
# What a ParamUse's gather looks like to a remat policy: SimpleFSDP's gathers are custom_vjps
# (their backward casts the gradient to fp32 before it is reduced), seen as one opaque primitive.
GATHER_PRIMITIVES = frozenset({"custom_vjp_call"})


class ParamUse(Protocol):
    def __call__(self, value: jax.Array, logical_axes: tuple[str | None, ...],
                 dtype: jnp.dtype) -> jax.Array: ...


def cast_param(value: jax.Array, logical_axes: tuple[str | None, ...],
               dtype: jnp.dtype) -> jax.Array:
    del logical_axes
    return value.astype(dtype)


_ACTIVE: contextvars.ContextVar[ParamUse] = contextvars.ContextVar("param_use", default=cast_param)


@contextlib.contextmanager
def param_use_context(fn: ParamUse) -> Iterator[None]:
    token = _ACTIVE.set(fn)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def use_param(param: nnx.Param, dtype: jnp.dtype) -> jax.Array:
    """The weight as the forward should see it (cast, and gathered when a mesh is active)."""
    value = _ACTIVE.get()(param[...], param.logical_axes, dtype)
    return checkpoint_name(value, GATHERED_PARAM)


def save_anything_except_gathered_params(prim: Any, *_: Any, **params: Any) -> bool:
    """Remat policy: save every value except the gathered weights (reshard_after_forward).

    Refusing the name alone is not enough: JAX would then save the value feeding the name,
    which is the gathered weight itself. So the gather primitives' outputs are refused too, and
    what is saved is their input, this device's cast shard; backward gathers it again.
    """
    if prim.name == "name":
        return params["name"] != GATHERED_PARAM
    return prim.name not in GATHER_PRIMITIVES
