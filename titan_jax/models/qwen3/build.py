"""A Qwen3 model as pure data + functions: abstract params, logical axes, init, apply.

The trainer holds parameters as a plain nested dict of arrays (what optax, orbax and the HF
converter all want) and re-attaches them to the Flax module graph inside `apply`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from titan_jax.models.qwen3.args import Qwen3Args
from titan_jax.models.qwen3.model import Qwen3, RematPolicy, stacked_logical_axes

Params = dict[str, Any]


def _path_names(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def path_name(path: tuple) -> str:
    """A pytree key path as a dotted parameter name, e.g. "layers.attention.wq"."""
    return ".".join(_path_names(path))


@dataclasses.dataclass(frozen=True)
class ModelDef:
    args: Qwen3Args
    graphdef: nnx.GraphDef
    abstract_params: Params  # nested dict of jax.ShapeDtypeStruct (fp32 master weights)
    logical_axes: Params  # same tree, leaves are tuples of logical axis names

    def init(self, key: jax.Array) -> Params:
        """Random init (torchtitan's scheme, see model.py). jit it with out_shardings to shard."""
        model = Qwen3(self.args, nnx.Rngs(params=key))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def apply(self, params: Params, tokens_BT: jax.Array, dtype: jnp.dtype = jnp.float32
              ) -> jax.Array:
        """Logits (B, T, V) in fp32; weights are read in `dtype`."""
        return nnx.merge(self.graphdef, params)(tokens_BT, dtype)

    def hidden_states(self, params: Params, tokens_BT: jax.Array,
                      dtype: jnp.dtype = jnp.float32) -> tuple[jax.Array, jax.Array]:
        """(final hidden states (B, T, D), output projection (D, V)), for chunked losses."""
        model = nnx.merge(self.graphdef, params)
        return model.hidden_states(tokens_BT, dtype), model.output_weight(dtype)

    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.abstract_params))

    def named_leaves(self, tree: Params) -> list[tuple[str, Any]]:
        """[("layers.attention.wq", leaf), ...] in a stable order (tuple leaves kept whole)."""
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]
        return [(path_name(p), leaf) for p, leaf in flat]


def build_model_def(args: Qwen3Args, remat: RematPolicy | None = None) -> ModelDef:
    """Traces the module once abstractly (no weights allocated) to get its structure."""
    abstract = nnx.eval_shape(lambda: Qwen3(args, nnx.Rngs(0), remat or RematPolicy()))
    graphdef, state = nnx.split(abstract, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    shapes, axes = {}, {}
    for path, var in flat:
        names = _path_names(path)
        _nested_set(shapes, names, jax.ShapeDtypeStruct(var.shape, var.dtype))
        _nested_set(axes, names, stacked_logical_axes(names, var.logical_axes))
    return ModelDef(args, graphdef, shapes, axes)


def _nested_set(tree: dict, names: tuple[str, ...], value: Any) -> None:
    for name in names[:-1]:
        tree = tree.setdefault(name, {})
    tree[names[-1]] = value
