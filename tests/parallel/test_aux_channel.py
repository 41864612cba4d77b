"""The model interface's aux channel and buffers, end to end through the compiled step.

- A test-only family registered beside qwen3 keeps a non-trainable buffer (a count of every
  token id seen, split over `tp` by its `vocab` axis) fed by the forward's aux stats: it is
  updated inside the step, equal on every mesh, untouched by the optimizer, saved and restored
  by checkpoints onto another mesh.
- Qwen3's own aux use: per-layer activation RMS (`metrics.log_activation_stats`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parallel_helpers import TINY, make_batches, preset_overrides, single_device_overrides
from parallel_helpers import tiny_config as base_config

from titan_jax.models import BuildOptions, register_model
from titan_jax.models.qwen3 import QWEN3, build_model_def
from titan_jax.models.qwen3.build import Qwen3Def
from titan_jax.models.qwen3.model import rope_tables
from titan_jax.train.checkpoint import Checkpointer
from titan_jax.train.step_report import _scalars
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py


@dataclasses.dataclass(frozen=True)
class CountingDef(Qwen3Def):
    """Qwen3 plus a buffer counting the token ids it has been trained on."""

    def init_buffers(self):
        return {"token_counts": jnp.zeros((self.args.vocab_size,), jnp.float32)}

    def forward(self, params, buffers, tokens_BT, dtype=jnp.float32, dropout_key=None):
        h, w, aux = super().forward(params, buffers, tokens_BT, dtype, dropout_key)
        counts = jnp.zeros((self.args.vocab_size,), jnp.float32).at[tokens_BT.reshape(-1)].add(1)
        return h, w, {**aux, "stats": {**aux["stats"], "token_counts": counts}}

    def update_buffers(self, buffers, stats):
        return {"token_counts": buffers["token_counts"] + stats["token_counts"]}


def build_counting(args, options: BuildOptions) -> CountingDef:
    base = build_model_def(args, options)
    return CountingDef(
        **{
            f.name: getattr(base, f.name)
            for f in dataclasses.fields(base)
            if f.init and not f.name.endswith("buffers") and f.name != "buffer_logical_axes"
        },
        abstract_buffers={"token_counts": jax.ShapeDtypeStruct((args.vocab_size,), jnp.float32)},
        buffer_logical_axes={"token_counts": ("vocab",)},
    )


register_model(dataclasses.replace(QWEN3, name="qwen3_counting", build=build_counting))


def tiny_config(*overrides: str):
    return base_config("--model.name", "qwen3_counting", *overrides)


def train(trainer, batches, state=None):
    state = trainer.init_state() if state is None else state
    for batch in batches:
        state, metrics = trainer.step_fn(state, trainer.batches.put(batch))
    return state, metrics


@pytest.fixture(scope="module")
def one_device_counts() -> np.ndarray:
    """The token counts one device's step leaves in the buffer after 3 batches."""
    one = build_trainer(tiny_config(*single_device_overrides()), jax.devices()[:1], model_args=TINY)
    state_one, _ = train(one, make_batches(3))
    return np.asarray(state_one["buffers"]["token_counts"])


@pytest.mark.parametrize("preset, implementation", [("fsdp4_tp2", "jit"), ("hsdp2x4", "shard_map")])
def test_buffer_is_updated_in_the_step_on_any_mesh(one_device_counts, preset, implementation):
    batches = make_batches(3)
    expected = np.bincount(
        np.concatenate([b["inputs"].reshape(-1) for b in batches]), minlength=TINY.vocab_size
    )
    many = build_trainer(
        tiny_config(*preset_overrides(preset), "--parallelism.fsdp_implementation", implementation),
        model_args=TINY,
    )
    if preset == "fsdp4_tp2":  # the buffer is sharded by the same table as the params
        assert many.state_shardings["buffers"]["token_counts"].spec == jax.P(("fsdp", "tp"))
    state_many, _ = train(many, batches)
    np.testing.assert_array_equal(state_many["buffers"]["token_counts"], expected)
    np.testing.assert_array_equal(one_device_counts, expected)
    # Not trainable: the optimizer state mirrors the params only.
    assert jax.tree.structure(state_many["opt_state"][0].mu) == jax.tree.structure(
        state_many["params"]
    )


def test_buffer_is_checkpointed_and_restored_onto_another_mesh(tmp_path):
    saver = build_trainer(tiny_config(*preset_overrides("fsdp4_tp2")), model_args=TINY)
    state, _ = train(saver, make_batches(2))
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(2, state, data_state={}, tokens_seen=0)
    loader = build_trainer(tiny_config(*preset_overrides("ddp8")), model_args=TINY)
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        restored = ckpt.restore(2, loader.abstract_state()).state
    np.testing.assert_array_equal(
        restored["buffers"]["token_counts"], state["buffers"]["token_counts"]
    )
    assert restored["buffers"]["token_counts"].sharding.is_equivalent_to(
        loader.state_shardings["buffers"]["token_counts"], 1
    )


def direct_activation_rms(model: Qwen3Def, params, tokens_BT) -> np.ndarray:
    """Each block's output RMS, running the stacked layers one by one."""
    qwen = nnx.merge(model.graphdef, params)
    x = jnp.take(params["tok_embeddings"], tokens_BT, axis=0)
    cos, sin = rope_tables(jnp.arange(tokens_BT.shape[1]), TINY.head_dim, TINY.rope_theta)
    layers_def, layers_state = nnx.split(qwen.layers)
    rms = []
    for i in range(TINY.n_layers):
        block = nnx.merge(layers_def, jax.tree.map(lambda a, i=i: a[i], layers_state))
        x = block(x, cos, sin)[0]
        rms.append(float(jnp.sqrt(jnp.mean(x * x))))
    return np.array(rms)


@pytest.mark.parametrize("preset", ["fsdp8", "fsdp2_tp4"])
def test_activation_rms_per_layer_through_the_aux_channel(preset):
    batch = make_batches(1)[0]
    # Two microbatches: stats are summed over microbatches and shards before the RMS.
    trainer = build_trainer(
        base_config(
            *preset_overrides(preset),
            "--training.global_batch_size",
            "16",
            "--metrics.log_activation_stats",
            "true",
        ),
        model_args=TINY,
    )
    state = trainer.init_state()
    params = jax.device_get(state["params"])
    both = {k: np.concatenate([v, v[::-1]]) for k, v in batch.items()}
    _, metrics = trainer.step_fn(state, trainer.batches.put(both))
    want = direct_activation_rms(trainer.plan.model, params, jnp.asarray(both["inputs"]))
    np.testing.assert_allclose(metrics["activation_rms"], want, rtol=1e-5)
    assert _scalars(jax.device_get(metrics))["activation_rms/1"] == pytest.approx(want[1], rel=1e-5)
