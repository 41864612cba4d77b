"""Remat (activation checkpointing) policies for a scanned block, shared by model families."""

from __future__ import annotations

from collections.abc import Callable

import jax

from titan_jax.models.sharding_hooks import GATHERED_PARAM, save_anything_except_gathered_params

REMAT_MODES = ("none", "full", "selective")


def remat_policy(mode: str, save_gathered_params: bool, saved_activations: tuple[str, ...]
                 ) -> Callable | None:
    """The `jax.checkpoint` policy of a block, or None for no remat at all.

    mode: "none" keeps every activation, "full" recomputes the block, "selective" keeps the
    named `saved_activations` (matmul and attention outputs) and recomputes the rest.
    save_gathered_params: keep the gathered weights (SimpleFSDP reshard_after_forward=never);
    otherwise backward gathers them again from the stored shards.
    """
    cp = jax.checkpoint_policies
    gathered = (GATHERED_PARAM,) if save_gathered_params else ()
    if mode == "none":
        return None if save_gathered_params else save_anything_except_gathered_params
    if mode == "full":
        return cp.save_only_these_names(*gathered)
    if mode == "selective":
        return cp.save_only_these_names(*saved_activations, *gathered)
    raise ValueError(f"activation_checkpoint.mode={mode!r}; valid: {', '.join(REMAT_MODES)}")
