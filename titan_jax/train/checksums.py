"""Checksums of a train state, for checkpoints: one number per array, computed where the arrays
live (no host copy), and whether every floating array is finite.

A checksum is the sum of an array's raw bits mod 2**32 (uint32 words, or uint16 / uint8 for
narrower dtypes): independent of the sharding and of the order of the sum, changed by any
overwritten word.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from titan_jax.trees import named_leaves

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _raw_bits_sum(x: jax.Array) -> jax.Array:
    """Sum mod 2**32 of the raw bits of `x` (uint32 words, or uint16 / uint8 for narrower
    dtypes): independent of the sharding and of the order of the sum."""
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint8)
    else:
        words = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return jnp.sum(words.astype(jnp.uint32), dtype=jnp.uint32)


@jax.jit
def _summaries(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(the checksum of every leaf, whether every floating leaf is finite), on the devices."""
    sums = jnp.stack([_raw_bits_sum(x) for x in leaves]) if leaves else jnp.zeros(0, jnp.uint32)
    finite = [jnp.isfinite(x).all() for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    return sums, jnp.stack(finite).all() if finite else jnp.bool_(True)


def _host_summary(x: jax.Array) -> tuple[int, bool]:
    """`_summaries` of this process's share of `x`, for arrays in host memory (CPU devices):
    numpy reads each distinct shard in place (no copy), ~15x faster than XLA:CPU's integer
    reduction."""
    total, finite = 0, True
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    for shard in x.addressable_shards:
        if shard.replica_id:  # each element counted once, whatever the replication
            continue
        a = np.asarray(shard.data)
        total += int(np.sum(a.view(_UINT[a.itemsize]), dtype=np.uint32))
        finite = finite and (not floating or bool(np.isfinite(a).all()))
    return total % 2**32, finite


def in_host_memory(tree: Any) -> bool:
    """Whether every array of `tree` lives on CPU devices, whose memory is the host's."""
    return all(d.platform == "cpu" for x in jax.tree.leaves(tree) for d in x.sharding.device_set)


def checksums(tree: Any) -> tuple[dict[str, int], bool]:
    """(checksum of every leaf by name, whether every floating leaf is finite).

    A checksum is a sum of the raw bits mod 2**32: independent of the sharding and the order of
    shards, changed by any overwritten word. Computed where the arrays live, without a host
    copy: on accelerators in one jitted pass (sums global already); on CPU devices, whose
    memory is the host's, by numpy in place, the processes' shares added up.
    """
    named = named_leaves(tree)
    leaves = list(named.values())
    if not in_host_memory(leaves):
        sums, finite = jax.device_get(_summaries(leaves))
        return {name: int(v) for name, v in zip(named, sums, strict=True)}, bool(finite)
    summaries = [_host_summary(x) for x in leaves]
    sums = np.array([s for s, _ in summaries] + [all(f for _, f in summaries)], np.uint32)
    if jax.process_count() > 1:  # add up every process's share
        gathered = np.asarray(multihost_utils.process_allgather(sums)).astype(np.uint64)
        sums = np.append(gathered[:, :-1].sum(0) % 2**32, gathered[:, -1].all())
    return {name: int(v) for name, v in zip(named, sums[:-1], strict=True)}, bool(sums[-1])
