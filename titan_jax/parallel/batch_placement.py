"""Where a global batch lives: which rows and token spans each process reads, and how its host
arrays become one global array sharded like the step's input.

The batch sharding (`state_shardings.batch_sharding`) splits rows over the data-parallel axes
and positions over `cp`; everything here is read off that sharding, never off process indices
(with tensor parallelism across hosts several processes hold the same rows). Under context
parallelism each row is laid out in load-balanced order (`context_parallel.to_load_balanced`)
before it is split.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from titan_jax.parallel.context_parallel import held_spans, to_load_balanced


@dataclasses.dataclass(frozen=True)
class BatchPlacement:
    sharding: NamedSharding  # of a (batch, seq) token array
    global_batch_size: int  # rows of one microbatch pass over every data-parallel rank
    cp: int  # context-parallel degree (each row's load-balanced chunks)

    @property
    def _local_devices(self) -> list[jax.Device]:
        return self.sharding.mesh.local_devices

    def rows(self, global_batch_size: int | None = None) -> list[int]:
        """The rows of a global batch that this process's devices hold, ascending."""
        n = self.global_batch_size if global_batch_size is None else global_batch_size
        return held_rows(self.sharding, n, self._local_devices)

    def spans(
        self, seq_len: int, devices: list[jax.Device] | None = None
    ) -> list[tuple[int, int]] | None:
        """The token ranges of each row (in the load-balanced layout's order) that `devices`
        (default: this process's) hold under context parallelism; None: all."""
        devices = self._local_devices if devices is None else devices
        held = held_seq(self.sharding, (self.global_batch_size, seq_len), devices)
        if held == slice(0, seq_len):
            return None
        return held_spans(held, seq_len, self.cp)

    def put(
        self,
        local: dict[str, np.ndarray],
        global_batch_size: int | None = None,
        seq_len: int | None = None,
    ) -> dict[str, jax.Array]:
        """This process's `rows` -> global arrays sharded like the step's batch. Whole rows are
        laid out in load-balanced order and only the chunks this process's devices hold are put
        on them. `seq_len`: the rows' whole length when `local` holds only this process's chunks
        (`spans`, in that order)."""
        n = self.global_batch_size if global_batch_size is None else global_batch_size
        out = {}
        for k, v in local.items():
            whole = v.shape[1] if seq_len is None else seq_len
            if v.shape[1] == whole:
                v = to_load_balanced(v, self.cp)
                v = v[:, held_seq(self.sharding, (n, whole), self._local_devices)]
            out[k] = jax.make_array_from_process_local_data(
                self.sharding, v, (n, whole, *v.shape[2:])
            )
        return out


def held_rows(sharding: NamedSharding, n_rows: int, devices: list[jax.Device]) -> list[int]:
    """Rows of an (n_rows, ...) array sharded by `sharding` that `devices` hold, ascending."""
    # Any seq length the sharding divides (context parallelism splits dim 1 too).
    index = sharding.devices_indices_map((n_rows, sharding.mesh.size))
    return sorted({r for d in devices for r in range(n_rows)[index[d][0]]})


def held_seq(sharding: NamedSharding, shape: tuple[int, int], devices: list[jax.Device]) -> slice:
    """The span of sequence positions (in load-balanced layout order) that `devices` hold."""
    index = sharding.devices_indices_map(shape)
    spans = [range(shape[1])[index[d][1]] for d in devices]
    return slice(min(r.start for r in spans), max(r.stop for r in spans))
