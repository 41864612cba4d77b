"""HF transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` as the reference: forward,
TorchTitan's loss and its gradients, and a PyTorch training loop running TorchTitan's recipe.
fp32 on CPU (torch's bf16 matmuls are ~100x slower than fp32 on CPUs without bf16 kernels)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from titan_jax.config import JobConfig
from titan_jax.train.loss import IGNORE_INDEX


def load_model(path: str | Path) -> torch.nn.Module:
    """The HF model directory `path` as a fp32 `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM`
    (from its config.json), eval mode."""
    from transformers import AutoModelForCausalLM  # slow; torchtitan runs need only torch
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per load clutters the report
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def cross_entropy(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """TorchTitan's loss: fp32 CE summed over valid tokens / their number.

    (torchtitan 0.3.0 `components/loss.py::cross_entropy_loss` sums; its trainer divides by the
    global count of valid tokens.)
    """
    total = F.cross_entropy(
        logits_BTV.flatten(0, 1).float(),
        labels_BT.flatten(),
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )
    return total / (labels_BT != IGNORE_INDEX).sum()


def loss_of_logits(logits_TV: np.ndarray, labels_T: np.ndarray) -> float:
    """TorchTitan's loss of one sequence's logits (from any model)."""
    return float(cross_entropy(torch.from_numpy(logits_TV)[None], _tokens(labels_T)))


def _tokens(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, np.int64))[None]


def forward_loss_grads(
    model: torch.nn.Module, inputs_T: np.ndarray, labels_T: np.ndarray
) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """(logits (T, V), loss, {HF parameter name: gradient} where the loss reaches) for one
    sequence."""
    model.zero_grad(set_to_none=True)
    logits = model(_tokens(inputs_T)).logits
    loss = cross_entropy(logits, _tokens(labels_T))
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return logits[0].detach().numpy(), loss.item(), grads


def load_peft_model(path: str | Path, adapter: str | Path) -> torch.nn.Module:
    """The HF model at `path` with PEFT's LoRA adapters from the adapter directory `adapter`
    (adapter_config.json + adapter_model.safetensors), trainable, fp32, eval mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_model(path), str(adapter), is_trainable=True).eval()


def train_trajectory(
    path: str | Path,
    recipe: JobConfig,
    batches: list[dict[str, np.ndarray]],
    lr_scheduler: Callable[[torch.optim.Optimizer, int], Any],
    adapter: str | Path | None = None,
) -> tuple[list[float], list[float]]:
    """(loss, lr) of each step of a PyTorch loop with the recipe, from the weights at `path`
    (with PEFT's adapters from `adapter`: then only they train, as PEFT trains them).

    torch.optim.AdamW with the recipe's hyper-parameters (weight decay on every trained
    parameter, as TorchTitan), `lr_scheduler(optimizer, total_steps)` stepped after each update
    (TorchTitan's LambdaLR), and clip_grad_norm_ at training.max_norm.
    """
    model = (load_model(path) if adapter is None else load_peft_model(path, adapter)).train()
    trained = [p for p in model.parameters() if p.requires_grad]
    o = recipe.optimizer
    optimizer = torch.optim.AdamW(
        trained, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
    )
    scheduler = lr_scheduler(optimizer, len(batches))
    max_norm = recipe.training.max_norm
    losses, lrs = [], []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        inputs = torch.from_numpy(np.asarray(batch["inputs"], np.int64))
        loss = cross_entropy(
            model(inputs).logits, torch.from_numpy(np.asarray(batch["labels"], np.int64))
        )
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(trained, max_norm)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, lrs
