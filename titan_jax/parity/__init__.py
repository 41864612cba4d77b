"""Parity with PyTorch: titan-jax against HF transformers and TorchTitan on the same weights.

`run` drives a comparison (`titan-jax parity`), `ours` is the titan-jax side, `hf_ref` and
`torchtitan_ref` the references (imported only when used: torch, transformers and torchtitan
are the optional `parity` extra), `metrics` the figures. Kept import-light: the CLI reads the
bars below when it builds its parser.
"""

import os

# torch's OpenMP threads busy-wait by default; in a process whose XLA thread pool has run, the
# two fight over the cores and torch steps run ~20x slower (measured: 2 threads, 2 cores).
# Passive waiting removes that. libgomp reads this when torch is first imported, so it only
# takes effect if this package is imported before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REFERENCES = ("hf", "torchtitan")
# DESIGN.md section 4, fp32. The loss bar is the trajectory's per-step bar: a loss is step 0.
BARS: dict[str, float] = {
    "logits_max_abs_diff": 1e-4,
    "kl_max": 1e-9,
    "loss_rel_diff": 1e-5,
    "grads_max_rel_diff": 1e-4,
    "trajectory_max_rel_diff": 1e-5,
}
