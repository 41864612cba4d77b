"""Remat (activation checkpointing) policies for a scanned block, shared by model families."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax

from titan_jax.models.sharding_hooks import GATHERED_PARAM

log = logging.getLogger(__name__)

REMAT_MODES = ("none", "full", "selective", "offload")
LAYER_INPUT = "layer_input"  # each scanned layer's input, named so a policy can offload it


def is_gathered_param(prim: Any, params: dict[str, Any]) -> bool:
    """Whether an equation (as a remat policy sees it) yields a gathered weight, by name only.

    A gather that is a custom_vjp (its backward casts the gradient to fp32 before reducing it)
    reaches the policy as one opaque `custom_vjp_call`, so its body is searched for the name;
    other custom_vjps (kernels, permutes) are left alone.
    """
    if prim.name == "name":
        return params["name"] == GATHERED_PARAM
    body = params.get("call_jaxpr")
    if body is None:
        return False
    return any(
        e.primitive.name == "name" and e.params.get("name") == GATHERED_PARAM
        for e in getattr(body, "jaxpr", body).eqns
    )


def save_anything_except_gathered_params(prim: Any, *_: Any, **params: Any) -> bool:
    """Remat policy: save every value except the gathered weights (reshard_after_forward).

    What is saved instead is the gather's input, this device's shard; backward gathers again.
    Reshapes are not saved either: they are free to redo, and a reshaped gathered weight (a
    kernel's 2-D view of it) would otherwise be kept in the weight's place.
    """
    return prim.name != "reshape" and not is_gathered_param(prim, params)


def remat_policy(
    mode: str,
    save_gathered_params: bool,
    saved_activations: tuple[str, ...],
    offload_layer_input: bool = False,
    always_saved: tuple[str, ...] = (),
) -> Callable | None:
    """The `jax.checkpoint` policy of a block, or None for no remat at all.

    mode: "none" keeps every activation, "full" recomputes the block, "selective" keeps the
    named `saved_activations` (the matmul outputs, attention's included) and recomputes the
    elementwise rest (norms, RoPE, SiLU * mul), "offload" keeps the same names but in host
    memory (pinned_host) between forward and backward.
    save_gathered_params: keep the gathered weights (SimpleFSDP reshard_after_forward=never);
    otherwise backward gathers them again from the stored shards. Kept on the device even when
    offloading: copying a weight to the host and back costs more than gathering it again.
    offload_layer_input: also keep each layer's input (`LAYER_INPUT`, which the layer scan
    names) in host memory; the remat then starts from that copy, so the device saves none.
    always_saved: names kept in every mode that recomputes: small values whose recompute
    would hold back the backward's schedule (the MoE routing: model.py).
    """
    if mode not in REMAT_MODES:
        raise ValueError(f"activation_checkpoint.mode={mode!r}; valid: {', '.join(REMAT_MODES)}")
    gathered = (GATHERED_PARAM,) if save_gathered_params else ()
    if mode == "none":
        return None if save_gathered_params else save_anything_except_gathered_params
    saved = [*gathered, *always_saved, *(saved_activations if mode == "selective" else ())]
    offloaded = [
        *((LAYER_INPUT,) if offload_layer_input else ()),
        *(saved_activations if mode == "offload" else ()),
    ]
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )


def offload_layer_input_for(offload: bool, platform: str) -> bool:
    """Whether a run offloads its layer inputs on devices of `platform`: not on CPU devices
    (one memory: the copies would only add work), with a warning, as `remat_mode_for`."""
    if offload and platform == "cpu":
        log.warning(
            "activation_checkpoint.offload_layer_input on CPU devices is off "
            "(no separate host memory to offload to)"
        )
        return False
    return offload


def remat_mode_for(mode: str, platform: str) -> str:
    """The mode a run uses on devices of `platform` (the target's, not the host's).

    CPU devices have one memory (host and "device" are the same RAM), so "offload" would only
    add copies: it runs as "selective" there, with a warning, and a TPU/GPU recipe still
    runs on a CPU box.
    """
    if mode == "offload" and platform == "cpu":
        log.warning(
            "activation_checkpoint.mode=offload on CPU devices runs as selective "
            "(no separate host memory to offload to)"
        )
        return "selective"
    return mode
