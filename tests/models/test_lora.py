"""LoRA adapters against PEFT's: the same adapter weights give PEFT's logits and gradients on a
HF Qwen3 (fp32), and fresh adapters are initialised as PEFT initialises them."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import random_hf_model
from tiny_model import UNTIED

from titan_jax.models.lora import Lora, adapters_off
from titan_jax.models.qwen3 import build_model_def, hf
from titan_jax.models.spec import BuildOptions
from titan_jax.trees import merge_nested, nested_get, split_by_name

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

try:  # the `parity` extra; CI installs it, so there a missing one is a failure, not a skip
    import peft
    import torch
except ImportError as e:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"needs the parity extra: {e}", allow_module_level=True)

from lora_fixtures import PROJECTIONS, lora_modules, ours_from_peft, peft_model  # noqa: E402


def mean_cross_entropy(logits_BTV, labels_BT):
    logp = jax.nn.log_softmax(logits_BTV, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels_BT[..., None], axis=-1))


@pytest.mark.parametrize(
    ("targets", "rank", "alpha"),
    [
        (tuple(PROJECTIONS), 4, 8.0),  # every projection a dense layer has
        (("q_proj", "v_proj"), 8, 32.0),  # PEFT's default targets for Qwen3
    ],
)
def test_logits_and_adapter_gradients_match_peft(tmp_path, targets, rank, alpha):
    model = peft_model(tmp_path, targets, rank, alpha)
    ours, params = ours_from_peft(model, targets, rank, alpha, tmp_path)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, UNTIED.vocab_size, (2, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    theirs_logits = model(torch.tensor(inputs)).logits
    theirs_loss = torch.nn.functional.cross_entropy(
        theirs_logits.reshape(-1, UNTIED.vocab_size), torch.tensor(labels).reshape(-1)
    )
    theirs_loss.backward()

    adapters, base = split_by_name(params, ours.trainable)

    def loss(adapters):
        return mean_cross_entropy(ours.apply(merge_nested(adapters, base), inputs), labels)

    logits = np.asarray(ours.apply(params, inputs))
    np.testing.assert_allclose(logits, theirs_logits.detach().numpy(), rtol=0, atol=1e-5)
    # The adapters matter: without them the logits are far from these.
    with model.disable_adapter():
        base_logits = model(torch.tensor(inputs)).logits.detach().numpy()
    assert np.abs(logits - base_logits).max() > 1e-2
    grads = jax.grad(loss)(adapters)
    for projection in targets:
        _, path, _ = PROJECTIONS[projection]
        node = nested_get(grads, ("layers", *path[:-1], f"{path[-1]}_lora"))
        for layer in range(UNTIED.n_layers):
            a, b = lora_modules(model, layer, projection)
            grad_a = np.asarray(node["lora_a"][layer])
            grad_b = np.asarray(node["lora_b"][layer])
            np.testing.assert_allclose(
                grad_a.reshape(-1, rank).T,
                a.weight.grad.numpy(),
                rtol=0,
                atol=1e-4,
                err_msg=f"{projection} A {layer}",
            )
            np.testing.assert_allclose(
                grad_b.reshape(rank, -1).T,
                b.weight.grad.numpy(),
                rtol=0,
                atol=1e-4,
                err_msg=f"{projection} B {layer}",
            )


def test_fresh_adapters_are_initialised_as_peft_initialises_them(tmp_path):
    """A: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (torch.nn.Linear's kaiming-uniform, a=sqrt(5)),
    fan_in the weight's whole input (o_proj's heads x head_dim); B: zeros."""
    targets, rank = ("q_proj", "o_proj", "down_proj"), 16
    model = peft.get_peft_model(
        random_hf_model(UNTIED), peft.LoraConfig(r=rank, lora_alpha=8, target_modules=list(targets))
    )
    ours = build_model_def(UNTIED, BuildOptions(lora=Lora(rank, 8.0, targets)))
    params = ours.init(jax.random.key(0))
    for projection in targets:
        _, path, _ = PROJECTIONS[projection]
        node = nested_get(params, ("layers", *path[:-1], f"{path[-1]}_lora"))
        theirs_a, theirs_b = lora_modules(model, 0, projection)
        fan_in = theirs_a.weight.shape[1]
        assert math.prod(node["lora_a"].shape[1:-1]) == fan_in
        bound = 1 / math.sqrt(fan_in)
        for a in (np.asarray(node["lora_a"]), theirs_a.weight.detach().numpy()):
            assert np.abs(a).max() <= bound
            assert np.abs(a).max() > 0.9 * bound, projection
            np.testing.assert_allclose(a.std(), bound / math.sqrt(3), rtol=0.15)
        assert not np.asarray(node["lora_b"]).any() and not theirs_b.weight.any()


def from_peft_layout(t, x):
    """A PEFT adapter tensor (its file's layout) in titan-jax's, the inverse of
    `safetensors_io.to_hf_layout`."""
    n = len(t.shape)
    dims = t.hf_dims or (tuple(range(t.n_in, n)), tuple(range(t.n_in)))
    order = [d for group in dims for d in group]
    return x.reshape([t.shape[d] for d in order]).transpose(np.argsort(order))


def by_peft_name(model, value):
    """{PEFT's file name: value(param)} of a live PEFT model's adapter params."""
    return {
        n.replace(".default", ""): value(p) for n, p in model.named_parameters() if ".lora_" in n
    }


# Attention and both expert parameters; one expert parameter alone (no nesting of PEFT's
# wrappers: its tensors lose `.base_layer`).
@pytest.mark.parametrize(
    "targets",
    [
        ("q_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"),
        ("v_proj", "experts.gate_up_proj"),
    ],
)
def test_moe_expert_adapters_match_peft(tmp_path, targets):
    """PEFT on transformers 5's fused experts (`target_parameters`): per expert, one A and B
    over gate_up_proj's gate and up outputs, and one over down_proj; logits and every
    adapter's gradient equal ours, and our PEFT export of the same adapters loads as them."""
    from hf_fixtures import random_hf_moe_model

    from titan_jax.models.qwen3.hf_config import read_hf_config
    from titan_jax.models.qwen3.hf_tensors import peft_tensors

    rank, alpha = 4, 8.0
    base = random_hf_moe_model(32)
    base.save_pretrained(str(tmp_path / "base"))
    args = read_hf_config(tmp_path / "base")
    experts = [f"mlp.{t}" for t in targets if t.startswith("experts.")]
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=[
                t for t in targets if t not in set(t.removeprefix("mlp.") for t in experts)
            ],
            target_parameters=experts,
        ),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()

    lora = Lora(rank, alpha, targets)
    ours = build_model_def(args, BuildOptions(lora=lora))
    theirs_values = by_peft_name(model, lambda p: p.detach().numpy())
    tensors = peft_tensors(args, lora)
    assert sorted(t.name for t in tensors) == sorted(theirs_values)
    adapters = split_by_name(
        jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), ours.abstract_params), ours.trainable
    )[0]
    for t in tensors:
        nested_get(adapters, t.path)[t.layer] = from_peft_layout(t, theirs_values[t.name])
    params = merge_nested(hf.load_hf_params(tmp_path / "base", args), adapters)

    tokens = np.random.default_rng(0).integers(0, args.vocab_size, (2, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    theirs_logits = model(torch.tensor(inputs)).logits
    torch.nn.functional.cross_entropy(
        theirs_logits.reshape(-1, args.vocab_size), torch.tensor(labels).reshape(-1)
    ).backward()
    logits = np.asarray(ours.apply(params, inputs))
    np.testing.assert_allclose(logits, theirs_logits.detach().numpy(), rtol=0, atol=1e-5)
    with model.disable_adapter():  # TRL's DPO reference: ours is every B zeroed
        theirs_off = model(torch.tensor(inputs)).logits.detach().numpy()
    assert np.abs(logits - theirs_off).max() > 1e-2
    np.testing.assert_allclose(
        ours.apply(adapters_off(params), inputs), theirs_off, rtol=0, atol=1e-5
    )

    adapter_params, frozen = split_by_name(params, ours.trainable)
    grads = jax.grad(
        lambda a: mean_cross_entropy(ours.apply(merge_nested(a, frozen), inputs), labels)
    )(adapter_params)
    theirs_grads = by_peft_name(model, lambda p: p.grad.numpy())
    for t in tensors:
        np.testing.assert_allclose(
            np.asarray(nested_get(grads, t.path)[t.layer]),
            from_peft_layout(t, theirs_grads[t.name]),
            rtol=0,
            atol=1e-4,
            err_msg=t.name,
        )

    # Our export of these adapters, loaded by PEFT onto the base: the same logits.
    hf.save_peft(tmp_path / "ours", jax.device_put(params), args, lora)
    base_again = random_hf_moe_model(32)
    loaded = peft.PeftModel.from_pretrained(base_again, str(tmp_path / "ours")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(
            loaded(torch.tensor(inputs)).logits.numpy(), logits, rtol=0, atol=1e-5
        )


def test_dropout_masks_the_adapter_input_only():
    """PEFT's `lora_B(lora_A(dropout(x)))`: the base matmul sees x whole; the adapter sees x
    with each element zeroed at the rate and the rest scaled by 1 / (1 - rate), the mask drawn
    from the layer's key and the adapter's own salt. No key (eval, generate): no dropout."""
    import zlib

    from flax import nnx

    from titan_jax.models.qwen3.adapter import adapter_beside
    from titan_jax.models.qwen3.model import project

    rng = np.random.default_rng(0)
    w = nnx.Param(jnp.asarray(rng.normal(size=(8, 6)), jnp.float32), logical_axes=("embed", "mlp"))
    rate = 0.3
    adapter = adapter_beside(
        Lora(2, 4.0, ("gate_proj",), rate), "gate_proj", w, 1, nnx.Rngs(params=0, lora=1)
    )
    adapter.lora_b[...] = jnp.asarray(rng.normal(size=(2, 6)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    key = jax.random.key(7)

    got = np.asarray(project(x, w, 1, None, adapter, key))
    keep = jax.random.bernoulli(
        jax.random.fold_in(key, zlib.crc32(b"gate_proj")), 1 - rate, (10, 8)
    )
    rows = x.reshape(10, 8)
    a, b = adapter.lora_a[...], adapter.lora_b[...]
    want = rows @ w[...] + (jnp.where(keep, rows / (1 - rate), 0) @ a @ b) * 2.0
    np.testing.assert_allclose(got, np.asarray(want).reshape(2, 5, 6), rtol=1e-6, atol=1e-6)
    without = np.asarray(project(x, w, 1, None, adapter))
    np.testing.assert_allclose(
        without,
        np.asarray(rows @ w[...] + rows @ a @ b * 2.0).reshape(2, 5, 6),
        rtol=1e-6,
        atol=1e-6,
    )
    assert np.abs(got - without).max() > 1e-2
    assert 0.1 < 1 - float(keep.mean()) < 0.5  # about the rate dropped
