"""Places where the step adds zeros for the compiler's sake: each ties a value to something
XLA must not move it away from. A float `x * 0` is not folded (it is NaN for x = inf), so the
zeros stay in the graph; each fuses into the op beside it and costs no pass over memory.
Each function names the test that fails without it.
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
    tests/parallel/test_tpu_aot.py::test_the_layer_loop_casts_each_layer_slice_in_the_loop.
    """
    if stored.dtype == dtype:
        return stored
    return (stored + lax.stop_gradient(stored) * 0).astype(dtype)


def give_shard_dim(x: jax.Array, shard_index: jax.Array) -> jax.Array:
    """`x` plus zeros computed from the batched shard index: inside the jit path's vmap over
    data shards, `x` then has the shard dimension (each shard's own copy, whose gradient the
    gather's backward casts before the cross-shard sum); `zeros_like` would be unbatched.
    Without it: tests/parallel/test_tpu_aot.py::test_jit_path_reduces_gradients_in_fp32."""
    return x + (shard_index * 0).astype(x.dtype)


def keep_sum_in_place(summed: jax.Array) -> jax.Array:
    """A partial sum that must stay in its dtype: XLA:TPU moves a later cast to bf16 in front
    of a small all-reduce; zeros added after the sum keep it behind. Without it:
    tests/parallel/test_tpu_aot.py::test_vocab_parallel_reductions_stay_fp32."""
    return summed + summed * 0


def zeros_of(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Zeros in `dtype` shaped like `x`, computed from it: inside shard_map they carry `x`'s
    manual-axis (varying) type, which a scan's carry must match. Without it:
    tests/train/test_loss.py::test_qwen3_vocabulary_chunks_on_both_simple_fsdp_paths."""
    return (x * 0).astype(dtype)
