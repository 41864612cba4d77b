"""store_frozen: the frozen base stored in place, wherever its weights sit in the module graph."""

import jax.numpy as jnp
from flax import nnx

from titan_jax.models.frozen_base import FrozenBase
from titan_jax.models.frozen_weights import IN_DIMS, QuantizedWeight, store_frozen
from titan_jax.models.sharding_hooks import FrozenParam


class _Projection(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones((64, 4), jnp.float32), logical_axes=("embed", "mlp"))
        self.w_in = nnx.Param(
            jnp.ones((64, 4), jnp.float32), logical_axes=("embed", "mlp"), **{IN_DIMS: (0,)}
        )


class _Stack(nnx.Module):
    """Projections by attribute and by nnx.List index (integer path keys)."""

    def __init__(self) -> None:
        self.head = _Projection()
        self.blocks = nnx.List([_Projection(), _Projection()])


def test_store_frozen_reaches_weights_inside_an_nnx_list():
    model = _Stack()
    store_frozen(model, FrozenBase("bfloat16"))
    for projection in (model.head, *model.blocks):
        for weight in (projection.w, projection.w_in):
            assert isinstance(weight, FrozenParam)
            assert weight[...].dtype == jnp.bfloat16


def test_store_frozen_quantizes_list_items_that_declare_their_input_dims():
    model = _Stack()
    store_frozen(model, FrozenBase("int8"))
    for projection in (model.head, *model.blocks):
        assert isinstance(projection.w_in, QuantizedWeight)
        assert isinstance(projection.w, FrozenParam)
