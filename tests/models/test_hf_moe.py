"""Qwen3-MoE against HF transformers' Qwen3MoeForCausalLM (fp32, aux loss off), through the
HF checkpoint files: logits, per-token KL, argmax, gradients, and the way back to HF."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titan_jax.models.qwen3 import build_model_def
from titan_jax.models.qwen3.hf import iter_hf_tensors, load_hf_params, save_hf
from titan_jax.models.qwen3.hf_config import HFCheckpointError, read_hf_config
from titan_jax.models.qwen3.hf_tensors import fused_expert_layout
from titan_jax.parity.metrics import kl_per_token
from titan_jax.train.loss import cross_entropy_sum

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

torch = pytest.importorskip("torch")  # the `parity` extra; CI installs it
transformers = pytest.importorskip("transformers")

SEQ = 512


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    from hf_fixtures import random_hf_moe_model

    model = random_hf_moe_model(SEQ)
    path = tmp_path_factory.mktemp("hf_moe")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def tokens():
    return np.random.default_rng(0).integers(0, 128, (1, SEQ)).astype(np.int64)


def test_hub_layout_is_per_expert(hf_moe):
    _, path = hf_moe
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names


def test_logits_kl_and_argmax_equal_hf(hf_moe):
    model, path = hf_moe
    args = read_hf_config(path)
    assert (args.num_experts, args.top_k, args.moe_inter_dim) == (8, 2, 16)
    ours = build_model_def(args)
    params = load_hf_params(path, args)
    x = tokens()
    with torch.no_grad():
        want = model(torch.from_numpy(x)).logits.numpy()[0]
    got = np.asarray(ours.apply(params, jnp.asarray(x, jnp.int32)))[0]
    assert np.abs(got - want).max() <= 1e-4
    assert kl_per_token(want, got).max() <= 1e-9
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_gradients_equal_hf(hf_moe):
    model, path = hf_moe
    args = read_hf_config(path)
    ours = build_model_def(args)
    params = load_hf_params(path, args)
    x = tokens()
    inputs, labels = x[:, :-1], x[:, 1:]

    def loss(p):
        h, w, _ = ours.forward(p, ours.init_buffers(), jnp.asarray(inputs, jnp.int32))
        return cross_entropy_sum(h, w, jnp.asarray(labels, jnp.int32)) / labels.size

    grads = fused_expert_layout(dict(iter_hf_tensors(jax.grad(loss)(params), args)), args)
    model.zero_grad()
    # HF shifts the labels itself: the whole sequence as input and labels is the same loss
    # (causal: the last position's logits take no part).
    model(torch.from_numpy(x), labels=torch.from_numpy(x)).loss.backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), atol=1e-4, rtol=1e-3, err_msg=name)


def test_export_loads_in_hf_with_the_same_logits(hf_moe, tmp_path):
    model, path = hf_moe
    args = read_hf_config(path)
    save_hf(tmp_path / "out", load_hf_params(path, args), args)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 8
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    x = torch.from_numpy(tokens())
    with torch.no_grad():
        np.testing.assert_array_equal(back(x).logits.numpy(), model(x).logits.numpy())


def test_a_missing_expert_tensor_names_it(hf_moe, tmp_path):
    _, path = hf_moe
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        HFCheckpointError, match="missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"
    ):
        load_hf_params(tmp_path)


def test_parity_cli_on_a_moe_checkpoint(hf_moe, tmp_path, capsys):
    """`titan-jax parity --reference all` on a Qwen3-MoE checkpoint: HF (logits, KL, greedy
    decode, gradients, a 3-step trajectory with the bias update off) and torchtitan's own MoE
    (forward) both within the bars."""
    from titan_jax.cli import main
    from titan_jax.parity import torchtitan_ref

    if torchtitan_ref.unavailable_reason():
        pytest.skip(torchtitan_ref.unavailable_reason())
    _, path = hf_moe
    out = tmp_path / "parity.json"
    code = main(
        [
            "parity",
            "--config",
            "configs/qwen3_debug.toml",
            "--hf-checkpoint",
            str(path),
            "--reference",
            "all",
            "--trajectory-steps",
            "3",
            "--training.seq_len",
            "32",
            "--seq-len",
            "480",  # the tiny model's 512 positions less 32 greedy tokens
            "--training.local_batch_size",
            "2",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert out.exists(), printed.out + printed.err
    report = json.loads(out.read_text())
    assert report["failures"] == [] and code == 0, printed.out
    tt = report["references"]["torchtitan"]
    assert tt["unavailable"] is None and tt["greedy_match"] is True, printed.out
    assert tt["kl_max"] <= 1e-9 and tt["logits_max_abs_diff"] <= 1e-4
    assert report["greedy_match"] is True and report["kl_max"] <= 1e-9, printed.out
    assert report["grads_max_rel_diff"] <= 1e-4 and report["trajectory_max_rel_diff"] <= 1e-5


def test_router_aux_loss_equals_hfs(hf_moe):
    """HF's optional load-balancing loss (router_aux_loss_coef, with output_router_logits):
    the same value over the same tokens."""
    import dataclasses

    model, path = hf_moe
    x = tokens()
    with torch.no_grad():
        want = float(model(torch.from_numpy(x), output_router_logits=True).aux_loss)
    args = read_hf_config(path)
    assert args.router_aux_loss_coef == 0.0  # off unless the checkpoint outputs router logits
    params = load_hf_params(path, args)
    coef = 0.01
    on = build_model_def(dataclasses.replace(args, router_aux_loss_coef=coef))
    _, _, aux = on.forward(params, on.init_buffers(), jnp.asarray(x, jnp.int32))
    n = x.size
    # Contributed as a sum over the batch's tokens: the step's division by the token count
    # makes it HF's coef * aux when every label is valid.
    np.testing.assert_allclose(float(aux["loss"]) / (coef * n), want, rtol=1e-5)


def test_files_in_transformers_5s_fused_layout_load_too(hf_moe, tmp_path):
    """safetensors written from a live transformers 5 model (experts fused into gate_up_proj
    and down_proj) load into the same params as the hub's per-expert files."""
    from safetensors.torch import save_file

    model, path = hf_moe
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    args = read_hf_config(path)
    fused, hub = load_hf_params(tmp_path, args), load_hf_params(path, args)
    jax.tree.map(np.testing.assert_array_equal, fused, hub)
    name = "model.layers.1.mlp.experts.gate_up_proj"  # float bits relabelled: named as stored
    state[name] = state[name].float().view(torch.int32)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=f"tensor '{name}' has dtype I32; a weight loads"):
        load_hf_params(tmp_path, args)


def test_convert_round_trips_a_moe_checkpoint(hf_moe, tmp_path):
    """`titan-jax convert` HF -> orbax -> HF on Qwen3-MoE: the tensors come back bitwise."""
    from safetensors.numpy import load_file

    from titan_jax.cli import main

    _, path = hf_moe
    assert main(["convert", "--from", "hf", "--to", "orbax", str(path), str(tmp_path / "o")]) == 0
    assert (
        main(["convert", "--from", "orbax", "--to", "hf", str(tmp_path / "o"), str(tmp_path / "h")])
        == 0
    )
    a = load_file(str(path / "model.safetensors"))
    b = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
