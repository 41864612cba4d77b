"""The local tier of multi-tier checkpoints in one process (titan_jax/train/local_tier.py) and
the choice between the tiers (train/start.py). Several processes, a kill and a peer restore:
tests/parallel/test_multi_tier.py."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from titan_jax.parallel.mesh import MESH_AXES
from titan_jax.train.checkpoint import CheckpointError
from titan_jax.train.local_tier import LocalTier
from titan_jax.train.start import newest_tier

RUN_INFO = {"resume": {"model.flavor": "debugmodel"}}
SIGNATURE = RUN_INFO["resume"]


@pytest.mark.parametrize(
    "local, persistent, expected",
    [
        (6, 4, ("local", 6)),
        (4, 6, ("persistent", 6)),
        (6, 6, ("persistent", 6)),  # the same step: the checked, shared copy
        (3, None, ("local", 3)),
        (None, 4, ("persistent", 4)),
        (None, None, None),
    ],
)
def test_a_resume_takes_the_newer_tier(local, persistent, expected):
    assert newest_tier(local, persistent) == expected


def _mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def _state(mesh: Mesh, scale: float) -> dict:
    sharding = NamedSharding(mesh, PartitionSpec())
    return {
        "params": {"w": jax.device_put(jnp.arange(12.0).reshape(3, 4) * scale, sharding)},
        "step": jax.device_put(jnp.int32(scale), sharding),
    }


def _tier(tmp_path, mesh: Mesh, persistent: str = "run/checkpoint") -> LocalTier:
    return LocalTier(
        tmp_path / "local",
        mesh,
        _abstract(mesh),
        interval=2,
        run_info=RUN_INFO,
        persistent=tmp_path / persistent,
    )


def _abstract(mesh: Mesh) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(mesh, 1)
    )


def test_a_local_step_restores_bitwise_with_its_record(tmp_path):
    mesh = _mesh()
    data = {"version": 3, "samples": 8}
    with _tier(tmp_path, mesh) as tier:
        assert tier.newest_complete_step() is None
        for step in (2, 4):
            tier.save(step, _state(mesh, step), data_state=data, tokens_seen=64 * step)
        tier.wait()
        assert tier.newest_complete_step() == 4
        restored = tier.restore(4, _abstract(mesh), signature=SIGNATURE)
    assert (restored.step, restored.data_state, restored.tokens_seen) == (4, data, 256)
    assert restored.source == f"local checkpoint step 4 in {tmp_path / 'local'}"
    expected = _state(mesh, 4)
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_resume_discards_the_newer_local_steps_and_a_restart_the_unfinished(tmp_path):
    mesh = _mesh()
    with _tier(tmp_path, mesh) as tier:
        for step in (2, 4):
            tier.save(step, _state(mesh, step), data_state={}, tokens_seen=0)
        tier.wait()
        tier.discard_after(2)
        assert tier.newest_complete_step() == 2
        folder = tier.directory
    (folder / "6.orbax-checkpoint-tmp-123").mkdir()  # a save a kill cut off
    with _tier(tmp_path, mesh) as tier:
        assert sorted(p.name for p in folder.iterdir()) == ["2", "run.json"]
        tier.save(4, _state(mesh, 4), data_state={}, tokens_seen=0)  # saved again, no clash
        tier.wait()
        assert tier.newest_complete_step() == 4


def test_a_damaged_or_foreign_local_step_is_refused(tmp_path):
    mesh = _mesh()
    with _tier(tmp_path, mesh) as tier:
        tier.save(2, _state(mesh, 2), data_state={}, tokens_seen=0)
        tier.wait()
        record_file = tier.directory / "2" / "data_iter" / "pygrain_states.json"
        with pytest.raises(CheckpointError, match="changed model.flavor='moe'"):
            tier.restore(2, _abstract(mesh), signature={"model.flavor": "moe"})
        states = json.loads(record_file.read_text())
        record = json.loads(states["0"])
        record["checksums"]["params.w"] += 1
        states["0"] = json.dumps(record)
        record_file.write_text(json.dumps(states))
        with pytest.raises(
            CheckpointError,
            match=rf"local checkpoint step 2 in {tmp_path / 'local'} is corrupt: params.w does "
            rf"not match the checksum recorded when it was saved; delete {tmp_path / 'local'} "
            rf"on every host",
        ):
            tier.restore(2, _abstract(mesh), signature=SIGNATURE)
    before = sorted(p.name for p in tier.directory.iterdir())
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint.local_folder={tmp_path / 'local'} holds the local checkpoints "
        rf"of the run in {tmp_path / 'run/checkpoint'}; give this run a local folder",
    ):
        _tier(tmp_path, mesh, persistent="other/checkpoint")
    assert sorted(p.name for p in tier.directory.iterdir()) == before == ["2", "run.json"]


def test_an_unreadable_local_step_gives_way_to_the_persistent_tier(tmp_path, caplog):
    mesh = _mesh()
    with _tier(tmp_path, mesh) as tier:
        tier.save(2, _state(mesh, 2), data_state={}, tokens_seen=0)
        tier.wait()
        for shards in (tier.directory / "2" / "state").glob("ocdbt.process_*"):
            shutil.rmtree(shards)
        assert tier.restore(2, _abstract(mesh), signature=SIGNATURE) is None
    assert f"local checkpoint step 2 in {tmp_path / 'local'} unreadable on processes [0]" in (
        caplog.text
    )
