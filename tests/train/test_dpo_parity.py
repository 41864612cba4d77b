"""DPO against TRL 1.16's DPOTrainer: on the same pairs of a random HF Qwen3 (fp32), titan-jax's
DPO loss (train/dpo.py, through the train step's `loss_and_grads`) and its gradients equal
what TRL's `compute_loss` gives, for the sigmoid and IPO losses, with LoRA (a PEFT model, the
reference its adapters off) and fully fine-tuned (a frozen reference copy)."""

import os

import jax
import numpy as np
import pytest
from hf_fixtures import random_hf_model
from pair_fixtures import pair_batch, random_pairs
from tiny_model import UNTIED

from titan_jax.models.qwen3 import build_model_def, hf
from titan_jax.train.dpo import DPO
from titan_jax.train.step import StepOptions, loss_and_grads
from titan_jax.trees import named_leaves, nested_get

pytestmark = pytest.mark.unoptimized_cpu_code  # tests/conftest.py

try:  # the `parity` extra; CI installs it, so there a missing one is a failure, not a skip
    import datasets
    import peft
    import torch
    import transformers
    import trl
except ImportError as e:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"needs the parity extra: {e}", allow_module_level=True)

from lora_fixtures import PROJECTIONS, lora_modules, ours_from_peft  # noqa: E402

BETA = 0.3
TARGETS = ("q_proj", "v_proj", "down_proj")
SEQ_LEN = 48  # one row holds a pair: no pair below is cut


def trl_inputs(pairs):
    """DataCollatorForPreference's batch of these pairs: every chosen sequence, then every
    rejected one, right-padded."""
    sequences = [pair[k] for k in (0, 1) for pair in pairs]
    width = max(len(ids) for ids, _ in sequences)

    def padded(rows):
        return torch.tensor(np.stack([np.pad(r, (0, width - len(r))) for r in rows]))

    return {
        "input_ids": padded([ids for ids, _ in sequences]),
        "attention_mask": padded([np.ones(len(ids), np.int64) for ids, _ in sequences]),
        "completion_mask": padded([mask.astype(np.int64) for _, mask in sequences]),
    }


def trl_trainer(model, ref_model, loss_type, tmp_path, peft_config=None):
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file="titan_jax/data/assets/tokenizer.json",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=BETA,
        loss_type=[loss_type],
        report_to="none",
        use_cpu=True,
        bf16=False,
    )  # fp32 throughout
    return trl.DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        processing_class=tokenizer,
        peft_config=peft_config,
        train_dataset=datasets.Dataset.from_dict(
            {"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]}
        ),
    )


def trl_loss(trainer, pairs):
    """TRL's DPO loss of the pairs (backpropagated into its model) and its logged metrics."""
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trl_inputs(pairs))
    loss.backward()
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def ours(model, params, batch, loss_type, reference=None):
    objective = DPO(beta=BETA, loss_type=loss_type, keeps_reference=reference is not None)
    options = StepOptions(objective=objective)
    fn = jax.jit(lambda p, r: loss_and_grads(model, p, {}, batch, options, reference=r))
    loss, grads, count, (_, sums) = fn(params, reference)
    return float(loss), grads, objective.metrics(sums, count)


def check_metrics(mine, theirs):
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        np.testing.assert_allclose(float(mine[key]), theirs[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_lora_dpo_loss_and_adapter_gradients_equal_trl(tmp_path, loss_type):
    """TRL wraps the base in a new adapter and takes the base (adapters off) as reference; the
    adapters are then moved (random, nonzero), as training would move them."""
    base = random_hf_model(UNTIED)
    base.save_pretrained(str(tmp_path))
    trainer = trl_trainer(
        base,
        None,
        loss_type,
        tmp_path,
        peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=list(TARGETS), lora_dropout=0.0),
    )
    model = trainer.model
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))
    our_model, params = ours_from_peft(model, TARGETS, 4, 8.0, tmp_path)
    pairs = random_pairs(4, UNTIED.vocab_size)
    theirs, metrics = trl_loss(trainer, pairs)
    loss, grads, mine = ours(our_model, params, pair_batch(pairs, SEQ_LEN), loss_type)

    assert abs(theirs - (np.log(2) if loss_type == "sigmoid" else 0)) > 1e-3  # not trivial
    np.testing.assert_allclose(loss, theirs, rtol=1e-5)
    check_metrics(mine, metrics)
    assert set(named_leaves(grads)) == our_model.trainable  # the adapters alone
    for projection in TARGETS:
        _, path, _ = PROJECTIONS[projection]
        node = nested_get(grads, ("layers", *path[:-1], f"{path[-1]}_lora"))
        for layer in range(UNTIED.n_layers):
            a, b = lora_modules(model, layer, projection)
            np.testing.assert_allclose(
                np.asarray(node["lora_a"][layer]).reshape(-1, 4).T,
                a.weight.grad.numpy(),
                rtol=0,
                atol=1e-4,
            )
            np.testing.assert_allclose(
                np.asarray(node["lora_b"][layer]).reshape(4, -1).T,
                b.weight.grad.numpy(),
                rtol=0,
                atol=1e-4,
            )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_full_dpo_loss_and_gradients_equal_trl(tmp_path, loss_type):
    base = random_hf_model(UNTIED)
    base.save_pretrained(str(tmp_path / "reference"))
    with torch.no_grad():  # the policy has moved away from the reference
        torch.manual_seed(2)
        for p in base.parameters():
            p.add_(0.05 * torch.randn_like(p))
    base.save_pretrained(str(tmp_path / "policy"))
    our_model = build_model_def(UNTIED)
    params = hf.load_hf_params(tmp_path / "policy", UNTIED)
    reference = hf.load_hf_params(tmp_path / "reference", UNTIED)
    pairs = random_pairs(4, UNTIED.vocab_size, seed=1)
    # TRL loads its reference from the policy's checkpoint path, as from a hub name.
    base.config._name_or_path = str(tmp_path / "reference")
    trainer = trl_trainer(base, None, loss_type, tmp_path)
    theirs, metrics = trl_loss(trainer, pairs)
    loss, grads, mine = ours(our_model, params, pair_batch(pairs, SEQ_LEN), loss_type, reference)
    np.testing.assert_allclose(loss, theirs, rtol=1e-5)
    check_metrics(mine, metrics)
    live = dict(base.named_parameters())
    ours_by_name = hf.live_hf_tensors(grads, UNTIED)
    assert set(ours_by_name) == set(live)
    for name, grad in ours_by_name.items():
        np.testing.assert_allclose(
            np.asarray(grad), live[name].grad.numpy(), rtol=0, atol=1e-4, err_msg=name
        )
    assert all(p.grad is None for p in trainer.ref_model.parameters())  # TRL's is frozen too
