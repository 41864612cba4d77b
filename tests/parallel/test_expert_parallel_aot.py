"""Expert parallelism compiled ahead of time for TPU v5p:2x2x4 (16 chips: fsdp 2 x ep 4 x tp 2)
on this CPU: the picks travel by `ragged-all-to-all` (no dense all-to-all of activations), what
the exchanges send per step is within 1.2x of the balanced picks' bytes, and the experts' FFN
stays split over tp inside the exchange (EP composes with TP). One compile, shared."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from parallel_helpers import GLOBAL_BATCH, SEQ_LEN, TINY, tiny_config

from titan_jax.tools import hlo_stats, inspect_step
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (the `tpu` extra; `make install` adds it)")

# dim 256: rows a whole number of TPU tiles (T(2,128)), so no layout padding rides along
TINY_MOE = dataclasses.replace(TINY, dim=256, num_experts=8, top_k=2, moe_inter_dim=32)
EP, TP, DATA_SHARDS = 4, 2, 8  # fsdp = DATA_SHARDS / EP


@pytest.fixture(scope="module")
def compiled():
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x4")
    config = tiny_config(
        "--parallelism.data_parallel_shard_degree", str(DATA_SHARDS),
        "--parallelism.expert_parallel_degree", str(EP),
        "--parallelism.tensor_parallel_degree", str(TP),
        "--training.local_batch_size", str(GLOBAL_BATCH // DATA_SHARDS),
        "--training.mixed_precision_param", "bfloat16")
    trainer = build_trainer(config, list(topology.devices), model_args=TINY_MOE)
    assert trainer.model.options.platform == "tpu"
    lowered = trainer.lower_step(trainer.abstract_state(), inspect_step.abstract_batch(trainer))
    assert "ragged_dot" in lowered.as_text()  # the target's grouped matmul
    return trainer, hlo_stats.collective_ops(hlo_stats.parse(lowered.compile().as_text()))


def test_picks_travel_by_ragged_all_to_all_only(compiled):
    trainer, ops = compiled
    assert trainer.parallelism.implementation == "shard_map"
    assert (trainer.degrees.ep, trainer.degrees.tp, trainer.degrees.fsdp) == (EP, TP, 2)
    # experts over ep, their model dim over fsdp, their hidden (FFN) dim over tp
    spec = trainer.state_shardings["params"]["layers"]["moe"]["w1"].spec
    assert tuple(spec[1:]) == ("ep", "fsdp", "tp"), spec
    kinds = {(c["op"], c["dtype"]) for c in ops}
    assert ("ragged-all-to-all", "bf16") in kinds and ("all-gather", "bf16") in kinds, kinds
    dense = [c for c in ops if c["op"] == "all-to-all"]
    # what is left of dense all-to-alls: the backward's offsets (EP integers), no activations
    assert all(c["dtype"].startswith(("s", "u")) and c["bytes"] <= 64 for c in dense), dense


def test_exchanges_send_the_balanced_picks_bytes(compiled):
    _, ops = compiled
    ragged = [c for c in ops if c["op"] == "ragged-all-to-all"]
    # bf16 rows both ways, forward and backward: the experts are used in the compute dtype
    assert {c["dtype"] for c in ragged} == {"bf16"}, ragged
    picks_per_chip = GLOBAL_BATCH // DATA_SHARDS * SEQ_LEN * TINY_MOE.top_k
    balanced = picks_per_chip * TINY_MOE.dim * 2  # bf16 rows
    sent = sum(c["bytes"] * c["executions"] for c in ragged)
    exchanges = sum(c["executions"] for c in ragged)
    # dispatch and combine, forward and backward, in each of the layers
    assert exchanges >= 4 * TINY_MOE.n_layers
    assert balanced * exchanges <= sent <= 1.2 * balanced * exchanges, (sent, exchanges)
