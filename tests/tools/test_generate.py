"""Tests for titan_jax/tools/generate.py and `titan-jax generate`."""

import jax
import numpy as np
import pytest
from cli_args import QUIET_METRICS
from tiny_model import TINY

from titan_jax.cli import main
from titan_jax.config import load_config
from titan_jax.data.tokenizer import load_tokenizer
from titan_jax.models.qwen3 import build_model_def, decode
from titan_jax.models.qwen3.hf import save_hf
from titan_jax.train import loop
from titan_jax.train.model_io import save_orbax
from titan_jax.train.trainer import build_trainer

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

PROMPT = "The for statement"


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    # One device of the 8 simulated ones: the CLI cannot re-size an initialised backend.
    monkeypatch.setattr("jax.devices", lambda *a: jax.local_devices()[:1])


def expected_text(params, n):
    tok = load_tokenizer("")
    ids = tok.encode(PROMPT)
    out = decode.generate(params, TINY, np.asarray([ids], np.int32), n)
    new = [int(t) for t in np.asarray(out)[0, len(ids) :]]
    if tok.eos_id in new:
        new = new[: new.index(tok.eos_id)]
    return PROMPT + tok.decode(new)


def generate(capsys, *args):
    code = main(
        [
            "generate",
            "--config",
            "configs/qwen3_debug.toml",
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "6",
            *args,
        ]
    )
    return code, capsys.readouterr()


def test_from_orbax_and_hf_directories(tmp_path, capsys):
    params = jax.jit(build_model_def(TINY).init)(jax.random.key(3))
    save_orbax(tmp_path / "orbax", params, TINY)
    save_hf(tmp_path / "hf", params, TINY)
    want = expected_text(params, 6)
    for source in (
        ["--checkpoint", str(tmp_path / "orbax")],
        ["--hf-checkpoint", str(tmp_path / "hf")],
    ):
        code, out = generate(capsys, *source)
        assert code == 0, out.err
        assert out.out == want + "\n"


def test_from_a_training_run_newest_step(tmp_path, capsys):
    config = load_config(
        "configs/qwen3_debug.toml",
        [
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "16",
            "--training.steps",
            "2",
            "--training.local_batch_size",
            "1",
            "--checkpoint.interval",
            "1",
            *QUIET_METRICS,
        ],
    )
    result = loop.train(config, jax.devices()[:1], model_args=TINY)
    capsys.readouterr()  # the training log
    code, out = generate(
        capsys,
        "--checkpoint",
        str(tmp_path / "checkpoint"),
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "1",
    )
    assert code == 0, out.err
    assert out.out.startswith(PROMPT) and str(tmp_path / "checkpoint" / "2") in out.err
    code, greedy = generate(capsys, "--checkpoint", str(tmp_path / "checkpoint" / "2"))
    assert greedy.out == expected_text(jax.device_get(result.state["params"]), 6) + "\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "/nonexistent"], "--checkpoint /nonexistent does not exist"),
        (["--checkpoint", "."], "is neither a checkpoint step folder"),
        (["--hf-checkpoint", "x", "--checkpoint", "y"], "not allowed with argument"),
        (["--checkpoint", "y", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
        (
            ["--checkpoint", "y", "--top-p", "0.9"],
            "--top-p 0.9 needs --temperature > 0 (it is 0: "
            "greedy decoding, which --top-p would not change); add e.g. "
            "--temperature 0.7, or leave "
            "--top-p out",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, args, message):
    try:
        code, out = generate(capsys, *args)
    except SystemExit as e:  # argparse's own errors
        code, out = e.code, capsys.readouterr()
    assert code == 2 and message in out.err


def test_decoding_on_an_fsdp_tp_mesh_equals_one_device(tmp_path, monkeypatch):
    monkeypatch.undo()  # all 8 simulated devices
    config = load_config(
        "configs/qwen3_debug.toml",
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.seq_len",
            "16",
        ],
    )
    trainer = build_trainer(config, jax.local_devices()[:4], model_args=TINY)
    params = jax.jit(build_model_def(TINY).init)(jax.random.key(5))
    sharded = jax.device_put(params, trainer.state_shardings["params"])
    prompt = np.asarray([[5, 6, 7, 8]], np.int32)
    with jax.set_mesh(trainer.plan.mesh):
        on_mesh = decode.generate(sharded, TINY, prompt, 8)
    np.testing.assert_array_equal(on_mesh, decode.generate(params, TINY, prompt, 8))
