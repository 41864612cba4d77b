"""Parity with PyTorch: titan-jax against HF transformers and TorchTitan on the same weights.

`run` drives a comparison (`titan-jax parity`), `ours` is the titan-jax side, `hf_ref` and
`torchtitan_ref` the references (imported only when used: torch, transformers and torchtitan
are the optional `parity` extra), `metrics` the figures. Kept import-light: the CLI reads the
bars below when it builds its parser.
"""

REFERENCES = ("hf", "torchtitan")
# fp32 bars (docs/PARITY.md). The loss bar is the trajectory's per-step bar: a loss is step 0.
BARS: dict[str, float] = {
    "logits_max_abs_diff": 1e-4,
    "kl_max": 1e-9,
    "loss_rel_diff": 1e-5,
    "grads_max_rel_diff": 1e-4,
    "trajectory_max_rel_diff": 1e-5,
}
