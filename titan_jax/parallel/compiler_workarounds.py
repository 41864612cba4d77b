"""Places where the step adds zeros for the compiler's sake: each ties a value to something
XLA must not move it away from. A float `x * 0` is not folded (it is NaN for x = inf), so the
zeros stay in the graph; each fuses into the op beside it and costs no pass over memory.
Each function names the test that fails without it. (Two more, after the vocabulary's staged
reduce-scatter and in the chunked loss's accumulator, were needed on jax 0.10.2 / libtpu
0.0.42.1; on jax 0.12 / libtpu 0.0.50 every test, the MoE recipes' fp32-reduction checks
included, passes without them, and they are gone.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def cast_in_loop(stored: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`stored` (one layer's slice of a scanned weight) cast to `dtype` where it is used.

    A plain convert of the slice XLA:TPU moves above the layer loop's dynamic-slice and hoists
    out of the loop: a bf16 copy of every layer's weight shard, live through forward and
    backward (3.5 GB per chip for 8B on v5p-8, docs/TPU.md). Zeros computed from the slice
    itself tie the cast to the iteration. Without it:
    tests/parallel/test_tpu_aot.py::
    test_layer_weights_are_cast_to_bf16_one_layer_at_a_time (its bf16 twins of the stacked
    weights come back).
    """
    if stored.dtype == dtype:
        return stored
    return (stored + lax.stop_gradient(stored) * 0).astype(dtype)


def give_shard_dim(x: jax.Array, shard_index: jax.Array) -> jax.Array:
    """`x` plus zeros computed from the batched shard index: inside the jit path's vmap over
    data shards, `x` then has the shard dimension (each shard's own copy, whose gradient the
    gather's backward casts before the cross-shard sum); `zeros_like` would be unbatched.
    Without it: tests/parallel/test_tpu_aot.py::test_v5p_fsdp_gathers_bf16_and_reduces_fp32
    [fsdp8-jit] (the gradients are reduced in bf16: 6 KB of fp32 reductions, not 0.4 MB)."""
    return x + (shard_index * 0).astype(x.dtype)
