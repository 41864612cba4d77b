"""Remat (activation checkpointing) policies for a scanned block, shared by model families."""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax

from titan_jax.models.sharding_hooks import GATHERED_PARAM, save_anything_except_gathered_params

log = logging.getLogger(__name__)

REMAT_MODES = ("none", "full", "selective", "offload")


def remat_policy(mode: str, save_gathered_params: bool, saved_activations: tuple[str, ...]
                 ) -> Callable | None:
    """The `jax.checkpoint` policy of a block, or None for no remat at all.

    mode: "none" keeps every activation, "full" recomputes the block, "selective" keeps the
    named `saved_activations` (the matmul outputs, attention's included) and recomputes the
    elementwise rest (norms, RoPE, SiLU * mul), "offload" keeps the same names but in host
    memory (pinned_host) between forward and backward.
    save_gathered_params: keep the gathered weights (SimpleFSDP reshard_after_forward=never);
    otherwise backward gathers them again from the stored shards. Kept on the device even when
    offloading: copying a weight to the host and back costs more than gathering it again.
    """
    cp = jax.checkpoint_policies
    gathered = (GATHERED_PARAM,) if save_gathered_params else ()
    if mode == "none":
        return None if save_gathered_params else save_anything_except_gathered_params
    if mode == "full":
        return cp.save_only_these_names(*gathered)
    if mode == "selective":
        return cp.save_only_these_names(*saved_activations, *gathered)
    if mode == "offload":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=list(gathered),
            names_which_can_be_offloaded=list(saved_activations),
            offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"activation_checkpoint.mode={mode!r}; valid: {', '.join(REMAT_MODES)}")


def remat_mode_for(mode: str, platform: str) -> str:
    """The mode a run uses on devices of `platform` (the target's, not the host's).

    CPU devices have one memory (host and "device" are the same RAM), so "offload" would only
    add copies: it runs as "selective" there, with a warning, and a TPU/GPU recipe still
    runs on a CPU box.
    """
    if mode == "offload" and platform == "cpu":
        log.warning("activation_checkpoint.mode=offload on CPU devices runs as selective "
                    "(no separate host memory to offload to)")
        return "selective"
    return mode
