"""LoRA training (`[lora]`): the adapters learn, the base weights stay bitwise as they were and
have no optimizer state, the compiled step holds less; bad `[lora]` keys are refused in one
line."""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest
from cli_args import QUIET_METRICS
from hf_fixtures import random_hf_model
from tiny_model import TINY

from titan_jax.config import ConfigError, load_config
from titan_jax.models.qwen3 import hf
from titan_jax.planner.inspect_step import abstract_batch
from titan_jax.train import loop
from titan_jax.train.plan_decisions import resolve_lora
from titan_jax.train.start import load_start
from titan_jax.train.trainer import build_trainer
from titan_jax.trees import named_leaves, split_by_name

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

LORA = ("--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "attention,mlp")


def make_config(folder, *overrides):
    return load_config(
        None,
        [
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "16",
            "--training.mixed_precision_param",
            "float32",
            "--optimizer.lr",
            "2e-2",
            "--lr_scheduler.warmup_steps",
            "1",
            "--metrics.log_freq",
            "1",
            *QUIET_METRICS,
            *overrides,
        ],
    )


def test_lora_fine_tunes_a_hf_base_model_leaving_it_bitwise(tmp_path):
    """The realistic run: a HF model's weights, fresh adapters, one text learnt. (A random
    tiny base cannot learn much through adapters: its 0.02-std tied embedding caps the logits
    the final norm's output can reach, and varied data hides the little it learns.)"""
    try:
        import transformers  # noqa: F401 (random_hf_model's)
    except ImportError as e:  # the `parity` extra; CI installs it
        if os.environ.get("CI"):
            raise
        pytest.skip(f"needs the parity extra: {e}")
    random_hf_model(TINY).save_pretrained(tmp_path / "hf")
    text = tmp_path / "fox.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 300)
    config = make_config(
        tmp_path / "run",
        *LORA,
        "--training.dataset",
        "text",
        "--training.dataset_path",
        str(text),
        "--checkpoint.initial_load_path",
        str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf",
        "true",
    )
    devices = jax.devices()[:2]  # FSDP over 2: the adapters are gathered and reduced too
    trainer = build_trainer(config, devices, model_args=TINY)
    first = jax.device_get(load_start(trainer, None).state)
    result = loop.train(config, devices, model_args=TINY)
    last = jax.device_get(result.state)

    losses = list(result.losses.values())
    assert len(losses) == 16 and np.mean(losses[-4:]) < losses[0] - 0.3, losses
    trainable = trainer.plan.model.trainable
    adapters, base = split_by_name(last["params"], trainable)
    first_adapters, first_base = split_by_name(first["params"], trainable)
    assert len(named_leaves(adapters)) == 2 * 7  # A and B of the 7 projections of a layer
    jax.tree.map(np.testing.assert_array_equal, base, hf.load_hf_params(tmp_path / "hf", TINY))
    jax.tree.map(np.testing.assert_array_equal, first_base, base)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), adapters, first_adapters)
    assert all(jax.tree.leaves(changed)), changed
    # Adam's moments exist for the adapters only: no leaf of any base weight's shape.
    base_shapes = {x.shape for x in jax.tree.leaves(base)}
    moment_shapes = {x.shape for x in jax.tree.leaves(last["opt_state"]) if x.ndim}
    assert moment_shapes == {x.shape for x in jax.tree.leaves(adapters)}
    assert not moment_shapes & base_shapes


@pytest.mark.slow
def test_lora_starts_from_a_full_fine_tuning_checkpoint(tmp_path):
    """`initial_load_path` to a titan-jax run of the base model (no adapters in it): its
    weights, fresh adapters; a LoRA run's own checkpoint brings its adapters."""
    base_run = make_config(
        tmp_path / "base", "--training.steps", "2", "--checkpoint.enable", "true"
    )
    base = jax.device_get(loop.train(base_run, jax.devices()[:1], model_args=TINY).state)

    def start(source):
        config = make_config(
            tmp_path / "lora", *LORA, "--checkpoint.initial_load_path", str(source)
        )
        trainer = build_trainer(config, jax.devices()[:1], model_args=TINY)
        restored = load_start(trainer, None)
        return trainer, jax.device_get(restored.state["params"])

    trainer, params = start(tmp_path / "base" / "checkpoint" / "2")
    adapters, frozen = split_by_name(params, trainer.plan.model.trainable)
    jax.tree.map(np.testing.assert_array_equal, frozen, base["params"])
    assert not any(b.any() for n, b in named_leaves(adapters).items() if n.endswith("lora_b"))

    lora_run = make_config(
        tmp_path / "lora_run", *LORA, "--training.steps", "2", "--checkpoint.enable", "true"
    )
    trained = jax.device_get(loop.train(lora_run, jax.devices()[:1], model_args=TINY).state)
    _, params = start(tmp_path / "lora_run" / "checkpoint" / "2")
    jax.tree.map(np.testing.assert_array_equal, params, trained["params"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("--lora.dropout", "0"),
        ("--lora.dropout", "0.2"),
        ("--lora.base_dtype", "nf4", "--lora.base_block_size", "8"),
    ],
)  # QLoRA
def test_a_lora_run_resumes_bitwise(tmp_path, overrides):
    """Adapters, their Adam moments and the frozen base are checkpointed and restored: a run
    stopped at step 2 and resumed ends as the uninterrupted one, bit for bit (with dropout
    too: its keys are the seed's and the step's; and with a quantized base)."""
    common = (
        *LORA,
        *overrides,
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.last_save_model_only",
        "false",
        "--lr_scheduler.decay_ratio",
        "0",
    )  # an LR that does not depend on the steps

    def run(folder, steps):
        config = make_config(tmp_path / folder, *common, "--training.steps", str(steps))
        return loop.train(config, jax.devices()[:1], model_args=TINY)

    whole = run("whole", 4)
    run("split", 2)
    resumed = run("split", 4)
    assert resumed.losses == {s: whole.losses[s] for s in (3, 4)}
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(resumed.state), jax.device_get(whole.state)
    )


def test_dropout_changes_training_the_same_way_for_a_seed(tmp_path):
    """Fresh adapters add nothing (B = 0), so the first step's loss is dropout's as well; then
    dropout changes the losses (two microbatches a step, each its own masks); the same state
    and step give the same masks, bit for bit."""

    def trainer(dropout):
        return build_trainer(
            make_config(
                tmp_path, *LORA, "--lora.dropout", dropout, "--training.global_batch_size", "4"
            ),
            jax.devices()[:1],
            model_args=TINY,
        )

    off, on = trainer("0"), trainer("0.3")
    assert off.options.dropout_seed is None and on.options.dropout_seed == 42
    init = jax.device_get(off.init_state())
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 4, 17), np.int32)

    def losses(trainer):
        state, out = jax.device_put(init, trainer.state_shardings), []
        for t in tokens:
            state, metrics = trainer.step_fn(
                state, trainer.batches.put({"inputs": t[:, :-1], "labels": t[:, 1:]})
            )
            out.append(float(metrics["loss"]))
        return out

    without, with_dropout = losses(off), losses(on)
    assert without[0] == with_dropout[0] and without[1] != with_dropout[1]
    assert losses(on) == with_dropout


def test_fresh_adapters_start_as_the_base_model(tmp_path):
    """B is zero: a fresh adapter adds nothing (A is PEFT's init: tests/models/test_lora.py)."""
    config = make_config(tmp_path, *LORA)
    trainer = build_trainer(config, jax.devices()[:1], model_args=TINY)
    params = jax.device_get(trainer.init_state()["params"])
    adapters, base = split_by_name(params, trainer.plan.model.trainable)
    full = build_trainer(make_config(tmp_path), jax.devices()[:1], model_args=TINY)
    # The base draws the keys it draws without adapters.
    jax.tree.map(np.testing.assert_array_equal, base, jax.device_get(full.init_state()["params"]))
    for name, b in named_leaves(adapters).items():
        assert name.endswith("lora_a") or not b.any(), name
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16)
    np.testing.assert_array_equal(
        trainer.plan.model.apply(params, tokens), full.plan.model.apply(base, tokens)
    )


def lora_losses(tmp_path, n_devices, *overrides, steps=3, lora=LORA, args=TINY, batch=4, init=None):
    """The losses of `steps` LoRA steps on fixed random batches of `batch` x 16 tokens, from
    one init (made on one device, changed by `init` if given) put onto this mesh."""
    config = make_config(tmp_path, *lora, "--training.global_batch_size", str(batch), *overrides)
    one = build_trainer(
        make_config(tmp_path, *lora, "--training.local_batch_size", str(batch)),
        jax.devices()[:1],
        model_args=args,
    )
    trainer = build_trainer(config, jax.devices()[:n_devices], model_args=args)
    start = jax.device_get(one.init_state())
    state = jax.device_put(init(start) if init else start, trainer.state_shardings)
    tokens = np.random.default_rng(0).integers(0, args.vocab_size, (steps, batch, 17), np.int32)
    losses = []
    for t in tokens:
        batch = trainer.batches.put({"inputs": t[:, :-1], "labels": t[:, 1:]})
        state, metrics = trainer.step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.mark.parametrize(
    ("n_devices", "local_batch", "overrides"),
    [
        # the jit path: adapters gathered over fsdp, B split over tp with its weight
        (
            4,
            "2",
            (
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
            ),
        ),
        (4, "1", ("--parallelism.fsdp_implementation", "shard_map")),  # the explicit twin, fsdp 4
        (1, "2", ()),  # two microbatches: the adapters' gradients accumulated
    ],
)
def test_lora_losses_are_the_same_sharded(tmp_path, n_devices, local_batch, overrides):
    sharded = lora_losses(
        tmp_path, n_devices, "--training.local_batch_size", local_batch, *overrides
    )
    np.testing.assert_allclose(
        sharded, lora_losses(tmp_path, 1, "--training.local_batch_size", "4"), rtol=1e-5
    )


MOE = dataclasses.replace(TINY, num_experts=8, top_k=2, moe_inter_dim=16)
EXPERT_LORA = (*LORA[:4], "--lora.target_modules", "attention,experts")


def sharp_router(state):
    """A router far from init's near-uniform one: with every probability ~1/8, rounding
    differences between meshes flip top-k near-ties and the runs part."""
    state["params"]["layers"]["moe"]["gate"] = state["params"]["layers"]["moe"]["gate"] * 50
    return state


@pytest.mark.parametrize(
    "overrides",
    [
        # ep4 x fsdp2: each rank holds 2 experts and their adapters, picks travel by the ragged
        # exchange (its CPU emulation), the experts' model dim split over fsdp
        pytest.param(
            (
                "--parallelism.data_parallel_shard_degree",
                "8",
                "--parallelism.expert_parallel_degree",
                "4",
            ),
            marks=pytest.mark.slow,
        ),
        ("--parallelism.data_parallel_shard_degree", "8"),  # fsdp8 (jit), experts gathered
    ],
)
def test_expert_adapters_train_to_one_devices_losses_sharded(tmp_path, overrides):
    losses = functools.partial(
        lora_losses, tmp_path, lora=EXPERT_LORA, args=MOE, batch=8, init=sharp_router, steps=2
    )
    sharded = losses(8, "--training.local_batch_size", "1", *overrides)
    np.testing.assert_allclose(sharded, losses(1, "--training.local_batch_size", "8"), rtol=1e-5)


def two_steps_leave_the_base(trainer, args):
    """(the state before, after two steps on one random batch, the adapters after), checking
    that the frozen base came out bitwise as it went in and the loss is finite."""
    state = trainer.init_state()
    first = jax.device_get(state)
    tokens = np.random.default_rng(0).integers(0, args.vocab_size, (2, 17), np.int32)
    for _ in range(2):
        state, metrics = trainer.step_fn(
            state, trainer.batches.put({"inputs": tokens[:, :-1], "labels": tokens[:, 1:]})
        )
    last = jax.device_get(state)
    assert np.isfinite(metrics["loss"])
    adapters, base = split_by_name(last["params"], trainer.plan.model.trainable)
    jax.tree.map(
        np.testing.assert_array_equal,
        base,
        split_by_name(first["params"], trainer.plan.model.trainable)[1],
    )
    return first, last, adapters


def test_expert_adapters_train_and_leave_the_experts_frozen(tmp_path):
    trainer = build_trainer(make_config(tmp_path, *EXPERT_LORA), jax.devices()[:1], model_args=MOE)
    assert {n for n in trainer.plan.model.trainable if ".moe." in n} == {
        "layers.moe.w1_and_w3_lora.lora_a",
        "layers.moe.w1_and_w3_lora.lora_b",
        "layers.moe.w2_lora.lora_a",
        "layers.moe.w2_lora.lora_b",
    }
    _, _, adapters = two_steps_leave_the_base(trainer, MOE)
    moe = adapters["layers"]["moe"]
    assert moe["w1_and_w3_lora"]["lora_b"].shape == (2, 8, 4, 2, 16)  # (L, E, r, gate|up, F)
    assert all(np.abs(a["lora_b"]).max() > 0 for a in moe.values())


def test_lora_on_a_moe_model_trains_the_attention_adapters_only(tmp_path):
    """A MoE layer has no dense SwiGLU: `attention,mlp` puts adapters on attention alone; the
    experts and router stay frozen and the expert bias (a buffer) still moves."""
    moe = dataclasses.replace(TINY, num_experts=4, top_k=2, moe_inter_dim=16)
    trainer = build_trainer(make_config(tmp_path, *LORA), jax.devices()[:1], model_args=moe)
    assert {n.split(".")[1] for n in trainer.plan.model.trainable} == {"attention"}
    first, last, adapters = two_steps_leave_the_base(trainer, moe)
    assert all(b.any() for n, b in named_leaves(adapters).items() if n.endswith("lora_b"))
    assert not np.array_equal(last["buffers"]["expert_bias"], first["buffers"]["expert_bias"])


def state_and_temp_bytes(config):
    trainer = build_trainer(config, jax.devices()[:1], model_args=TINY)
    compiled = trainer.lower_step(trainer.abstract_state(), abstract_batch(trainer)).compile()
    memory = compiled.memory_analysis()
    return memory.argument_size_in_bytes, memory.temp_size_in_bytes


def test_lora_step_holds_no_gradient_or_moments_of_the_base(tmp_path):
    full_args, _ = state_and_temp_bytes(make_config(tmp_path))
    lora_args, _ = state_and_temp_bytes(make_config(tmp_path, *LORA))
    # Full fine-tuning holds weights + two Adam moments; LoRA the weights and a little more.
    assert lora_args < 0.4 * full_args, (lora_args, full_args)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("--lora.alpha", "16"), "lora.alpha=16.0 has no effect with lora.rank=0"),
        (("--lora.target_modules", "attention"), "lora.target_modules='attention' has no effect"),
        (("--lora.rank", "-2"), "lora.rank=-2 must be >= 1, or 0 (off)"),
        ((*LORA[:4], "--lora.target_modules", "q_proj,query"), "'query' is no target"),
        ((*LORA[:4], "--lora.target_modules", " , "), "lora.target_modules is empty"),
        ((*LORA[:4], "--lora.target_modules", "q_proj,q_proj"), "names a target twice"),
        ((*LORA, "--lora.dropout", "1"), "lora.dropout=1.0 must be in [0, 1)"),
        ((*LORA, "--lora.dropout", "-0.1"), "lora.dropout=-0.1 must be in [0, 1)"),
        (
            (*LORA[:4], "--lora.target_modules", "q_proj,experts", "--lora.dropout", "0.1"),
            "PEFT's fused-expert adapters take no dropout",
        ),
        (("--lora.dropout", "0.1"), "lora.dropout=0.1 has no effect with lora.rank=0"),
        ((*LORA, "--lora.alpha", "0"), "lora.alpha=0.0 must be > 0"),
    ],
)
def test_bad_lora_keys_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match="^[^\n]*$") as e:
        make_config(tmp_path, *overrides)
    assert message in str(e.value)


def test_targets_the_model_lacks_are_refused(tmp_path):
    moe = dataclasses.replace(TINY, num_experts=4, top_k=2, moe_inter_dim=16)
    config = make_config(tmp_path, *LORA[:4], "--lora.target_modules", "mlp,down_proj")
    with pytest.raises(
        ConfigError, match="matches no projection of model.flavor=debugmodel, which is MoE"
    ):
        resolve_lora(config, moe)
    assert resolve_lora(config, TINY).projections == ("gate_proj", "up_proj", "down_proj")
    attention = make_config(tmp_path, *LORA[:4], "--lora.target_modules", "mlp,o_proj")
    assert resolve_lora(attention, moe).projections == ("o_proj",)
    experts = make_config(tmp_path, *LORA[:4], "--lora.target_modules", "experts.down_proj")
    with pytest.raises(
        ConfigError,
        match="^[^\n]*matches no projection of model.flavor="
        "debugmodel, which is dense .it has no experts.; "
        "name some of attention,mlp,q_proj",
    ):
        resolve_lora(experts, TINY)
    assert resolve_lora(experts, moe).projections == ("experts.down_proj",)
