"""DPO (train/dpo.py, data/pairs.py): per-token log-probabilities by the chunked loss path, a
pair's row, the shipped recipe raising the held-out reward accuracy above chance, a kill -9
and resume ending bitwise as the uninterrupted run, and bad input refused in one line."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_args import QUIET_METRICS
from pair_fixtures import pair_batch, random_pairs
from test_resume import env, killed_and_resumed  # noqa: F401  (env: a fixture)
from tiny_model import TINY

from titan_jax.cli import main
from titan_jax.config import load_config
from titan_jax.data.pairs import CHOSEN, PADDING, REJECTED, fitted_lengths, pair_row
from titan_jax.data.windows import IGNORE_INDEX
from titan_jax.models.lora import NO_LORA, adapters_off
from titan_jax.models.qwen3 import build_model_def
from titan_jax.train import loss as loss_module
from titan_jax.train.dpo import DPO
from titan_jax.train.trainer import build_trainer
from titan_jax.trees import split_by_name

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "qwen3_debug_dpo.toml")
QUIET = [
    *QUIET_METRICS,
    "--checkpoint.enable",
    "false",
]


@pytest.fixture
def one_device(monkeypatch):
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])


def test_token_log_probs_chunked_equal_log_softmax_with_gradients(monkeypatch):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(3, 10, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
    labels = jnp.asarray(
        np.where(rng.random((3, 10)) < 0.3, IGNORE_INDEX, rng.integers(0, 50, (3, 10))), jnp.int32
    )
    weights = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)

    def plain(h, w):
        logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w), axis=-1)
        picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
        return jnp.where(labels != IGNORE_INDEX, picked, 0.0)

    def weighted(fn):
        return jax.value_and_grad(lambda h, w: jnp.sum(weights * fn(h, w)), argnums=(0, 1))

    expected = weighted(plain)(h, w)
    whole = weighted(lambda h, w: loss_module.token_log_probs(h, w, labels))(h, w)
    monkeypatch.setattr(loss_module, "MAX_LOGITS_PER_CHUNK", 50 * 7)  # 5 chunks, one padded
    chunked = weighted(lambda h, w: loss_module.token_log_probs(h, w, labels))(h, w)
    for got in (whole, chunked):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, expected
        )
    np.testing.assert_array_equal(loss_module.token_log_probs(h, w, labels)[labels < 0], 0)


def test_a_pair_row_holds_both_sequences_apart_and_labels_their_completions():
    chosen = (np.arange(10, 16), np.array([0, 0, 0, 1, 1, 1], bool))
    rejected = (np.arange(20, 24), np.array([0, 0, 0, 1], bool))
    row = pair_row([chosen, rejected], 12)
    ids, segments, positions = row["inputs"].T
    assert ids[:10].tolist() == [*range(10, 16), *range(20, 24)]
    assert segments.tolist() == [CHOSEN] * 6 + [REJECTED] * 4 + [PADDING] * 2
    assert positions[:10].tolist() == [*range(6), *range(4)]
    # Token t's label is token t + 1 where that one is a completion token.
    assert row["labels"].tolist() == [
        -100,
        -100,
        13,
        14,
        15,
        -100,
        -100,
        -100,
        23,
        -100,
        -100,
        -100,
    ]
    assert fitted_lengths(6, 4, 8) == (4, 4) and fitted_lengths(3, 9, 8) == (3, 5)
    assert fitted_lengths(9, 9, 8) == (4, 4) and fitted_lengths(2, 3, 8) == (2, 3)


def test_a_pair_cut_to_no_completion_token_is_not_counted():
    cut = pair_row(
        [
            (np.arange(6), np.array([0, 0, 0, 0, 1, 1], bool)),
            (np.arange(6), np.array([0, 0, 0, 0, 0, 1], bool)),
        ],
        8,
    )  # 4 + 4 kept
    whole = pair_row(
        [(np.arange(3), np.array([0, 1, 1], bool)), (np.arange(3), np.array([0, 0, 1], bool))], 8
    )
    inputs, labels = (np.stack([cut[k], whole[k]]) for k in ("inputs", "labels"))
    assert float(DPO().count(jnp.asarray(inputs), jnp.asarray(labels))) == 1.0


LORA = ["--lora.rank", "4", "--lora.target_modules", "attention,mlp"]
MOE = dataclasses.replace(TINY, num_experts=8, top_k=2, moe_inter_dim=16)


def lora_dpo_trainer(tmp_path, args, *lora):
    config = load_config(
        RECIPE,
        [
            *QUIET,
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--validation.enable",
            "false",
            "--optimizer.lr",
            "1e-2",
            "--job.dump_folder",
            str(tmp_path),
            "--lora.rank",
            "4",
            *lora,
        ],
    )
    return build_trainer(config, jax.devices()[:1], model_args=args)


def test_lora_dpo_on_expert_adapters_takes_the_base_model_as_reference(tmp_path):
    """The joined expert adapter (`w1_and_w3_lora`, B (L, E, r, gate|up, F)) is off like the
    others when its B is zero: once a step has moved every adapter, the reference's log-probs
    are the base model's, bitwise; that step's policy was the reference (loss log 2)."""
    trainer = lora_dpo_trainer(tmp_path, MOE, "--lora.target_modules", "attention,experts")
    batch = pair_batch(random_pairs(4, MOE.vocab_size), 64)
    state, metrics = trainer.step_fn(trainer.init_state(), trainer.batches.put(batch))
    assert float(metrics["loss"]) == pytest.approx(np.log(2), abs=1e-6)
    state = jax.device_get(state)
    adapters, base = split_by_name(state["params"], trainer.plan.model.trainable)
    assert all(np.abs(a["lora_b"]).max() > 0 for a in adapters["layers"]["moe"].values())
    plain = build_model_def(MOE, dataclasses.replace(trainer.plan.model.options, lora=NO_LORA))

    def log_probs(model, params):
        h, w_out, _ = jax.jit(model.forward, static_argnums=3)(
            params, state["buffers"], batch["inputs"], jnp.float32
        )
        return loss_module.token_log_probs(h, w_out, batch["labels"])

    np.testing.assert_array_equal(
        log_probs(trainer.plan.model, adapters_off(state["params"])), log_probs(plain, base)
    )


def test_lora_dropout_is_the_policys_alone(tmp_path):
    """With lora.dropout the DPO step's policy forward draws the step's masks (another step,
    other log-probs from the same params), the reference's log-probs take none: they stay the
    same (reference = policy - reward / beta, as the step logs them)."""
    trainer = lora_dpo_trainer(
        tmp_path, TINY, "--lora.target_modules", "attention,mlp", "--lora.dropout", "0.3"
    )
    assert trainer.options.dropout_seed == 42
    batch = trainer.batches.put(pair_batch(random_pairs(4, TINY.vocab_size), 64))
    moved, _ = trainer.step_fn(trainer.init_state(), batch)  # B is nonzero from here
    moved = jax.device_get(moved)

    def logps_at(step):  # (policy, reference) summed log-probs of the chosen and rejected
        state = jax.device_put({**moved, "step": np.int32(step)}, trainer.state_shardings)
        metrics = jax.device_get(trainer.step_fn(state, batch)[1])
        policy = np.array([metrics["logps/chosen"], metrics["logps/rejected"]])
        rewards = np.array([metrics["rewards/chosen"], metrics["rewards/rejected"]])
        return policy, policy - rewards / trainer.options.objective.beta

    (policy_1, reference_1), (policy_2, reference_2) = logps_at(1), logps_at(2)
    assert np.abs(policy_1 - policy_2).max() > 1e-3
    np.testing.assert_allclose(reference_1, reference_2, rtol=1e-5)


FSDP4 = ("--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "meshes"),
    [
        (
            (),
            (
                FSDP4,  # the jit path, the vocabulary split over fsdp, each shard its own pairs
                (
                    "--parallelism.data_parallel_shard_degree",
                    "2",
                    "--parallelism.tensor_parallel_degree",
                    "2",
                    "--parallelism.fsdp_implementation",
                    "shard_map",
                    "--training.local_batch_size",
                    "4",
                ),
            ),
        ),
        (LORA, (FSDP4,)),  # the reference: the adapters off
    ],
)
def test_dpo_losses_are_one_devices_sharded(tmp_path, extra, meshes):
    """(policy, reference) params go through SimpleFSDP's loss map as the params do, on either
    path: the same losses as on one device (and with LoRA, whose reference is the adapters
    off), from one init, on the same 8 pairs."""

    def trainer(n_devices, *mesh):
        config = load_config(
            RECIPE,
            [
                *QUIET,
                "--training.seq_len",
                "64",
                "--training.global_batch_size",
                "8",
                "--validation.enable",
                "false",
                "--optimizer.lr",
                "1e-2",
                "--lr_scheduler.warmup_steps",
                "1",
                "--job.dump_folder",
                str(tmp_path),
                *extra,
                *mesh,
            ],
        )
        return build_trainer(config, jax.devices()[:n_devices], model_args=TINY)

    one = trainer(1, "--training.local_batch_size", "8")
    init = jax.device_get(one.init_state())
    batch = pair_batch(random_pairs(8, TINY.vocab_size), 64)

    def losses(trainer):  # three steps on the same pairs
        state, out = jax.device_put(init, trainer.state_shardings), []
        for _ in range(3):
            state, metrics = trainer.step_fn(state, trainer.batches.put(batch))
            out.append(float(metrics["loss"]))
        return out

    expected = losses(one)
    assert expected[0] == pytest.approx(np.log(2), abs=1e-6) and expected[2] < expected[0]
    for mesh in meshes:
        np.testing.assert_allclose(losses(trainer(4, *mesh)), expected, rtol=1e-5)


def preference_file(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


PAIR = {"prompt": "What is 2 + 2?", "chosen": "It is 4.", "rejected": "It is 5."}


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({**PAIR, "rejected": PAIR["chosen"]}, "pairs.jsonl:1: chosen equals rejected"),
        ({"prompt": "x", "chosen": "y"}, "pairs.jsonl:1: no field 'rejected'"),
        (
            {**PAIR, "chosen": [{"role": "user", "content": "y"}]},
            "pairs.jsonl:1: chosen has no assistant message to train on",
        ),
    ],
)
def test_bad_pairs_are_one_line_naming_file_and_line(tmp_path, capsys, one_device, record, message):
    data = preference_file(tmp_path / "pairs.jsonl", [record, PAIR])
    run = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            RECIPE,
            *QUIET,
            "--training.steps",
            "1",
            "--validation.enable",
            "false",
            "--training.dataset_path",
            data,
            "--job.dump_folder",
            str(run),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not run.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--dpo.enable", "false"],
            "training.data_format='preference' trains with DPO: set dpo.enable=true",
        ),
        (
            ["--training.data_format", "messages"],
            "dpo.enable=true trains on preference pairs, not training.data_format='messages'",
        ),
        (
            ["--dpo.enable", "false", "--training.data_format", "messages", "--dpo.beta", "0.2"],
            "dpo.beta=0.2 has no effect with dpo.enable=false",
        ),
        (
            ["--training.document_positions", "false"],
            "needs training.document_mask=true and training.document_positions=true",
        ),
        (["--dpo.beta", "0"], "dpo.beta=0.0 must be a number > 0"),
        (
            ["--parallelism.context_parallel_degree", "2"],
            "context_parallel_degree=2 is not supported with DPO",
        ),
    ],
)
def test_dpo_config_mistakes_are_one_line(tmp_path, capsys, overrides, message):
    code = main(
        [
            "train",
            "--config",
            RECIPE,
            *QUIET,
            *overrides,
            "--job.dump_folder",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_dpo_recipe_raises_the_held_out_reward_accuracy_above_chance(
    tmp_path, capsys, one_device
):
    code = main(
        [
            "train",
            "--config",
            RECIPE,
            *QUIET,
            "--training.steps",
            "8",
            "--training.local_batch_size",
            "4",
            "--validation.local_batch_size",
            "6",
            "--lr_scheduler.warmup_steps",
            "2",
            "--validation.freq",
            "8",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    held_out = [r for r in rows if "val_loss" in r]
    assert len(held_out) == 1, held_out
    # 18 held-out pairs, 3 batches of 6: all of them, about topics training never saw.
    assert held_out[0]["val_pairs"] == 18
    assert held_out[0]["val_rewards/accuracies"] > 0.75, held_out
    assert held_out[0]["val_loss"] < np.log(2), held_out
    first = rows[0]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the policy is the reference
    (manifest,) = tmp_path.glob("data/jsonl-train-*/manifest.json")
    assert json.loads(manifest.read_text())["pairs"] is True


RESUME = [  # killed_and_resumed adds the steps and the checkpoints
    "--config",
    RECIPE,
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "2",
    "--validation.enable",
    "false",
    "--metrics.log_freq",
    "1",
    *QUIET_METRICS,
    "--checkpoint.enable",
    "true",
]


@pytest.mark.slow
def test_a_dpo_run_killed_and_resumed_ends_bitwise_as_the_uninterrupted_one(env, tmp_path):  # noqa: F811
    """kill -9 after checkpoint 2; the resumed run restores the policy, its optimizer state,
    the reference copy and the pair stream's position: its losses and final state equal the
    uninterrupted run's, bit for bit."""
    final_state, _ = killed_and_resumed(env, tmp_path, args=RESUME)
    assert "reference" in final_state
