"""The 1F1B pipeline schedule: forward and backward ticks alternate inside the one jitted step,
so each stage keeps a bounded number of microbatches' inputs (set by the degree, not by the
microbatch count), where GPipe's keeps all m (`titan_jax/models/pipeline.py`).

Why its own gradients. Autodiff's backward of a tick scan is the transposed scan: every
forward tick, then every backward tick. To interleave them the pipeline computes its gradients
while it runs forward: one `jax.custom_vjp` around the stacked layers, the head (final norm,
output projection and loss) and each microbatch's loss. Its forward runs the 1F1B ticks and
returns the summed loss, with the gradients of the layers, the head and the pipeline's input
as residuals; its backward scales them by the loss's cotangent (the loss is a sum, linear in
it). The weights are read through the model's hooks inside each stage's `jax.vjp`, so
SimpleFSDP gathers them in the param dtype and casts their gradients to the reduce dtype
(fp32) before any cross-shard sum, as in the plain step.

Schedule. Placement as GPipe's (stage s holds layers [s L/p, (s+1) L/p)), microbatches of
the batch's rows as GPipe's. At tick t stage s runs the forward of microbatch f = t - s and
the backward of microbatch b = t - 2(p - 1) + s: the last stage takes the backward of the
microbatch it has just run forward (the head's loss and its cotangent at once); the cotangent
of a stage's input goes to the stage before it one tick later, by a roll along the stage dim
(a collective-permute, like the forward's hand-off). The backward of a stage is a `jax.vjp`
that recomputes its forward from the saved stage input (the layers' remat policy applies
inside it). Ticks 0 .. p - 2 hold no backward and the last p - 1 no forward: those phases are
scans of their own that skip the idle half, so the step takes (m + p - 1) forward-plus-backward
ticks, GPipe's bubble (p - 1) / (m + p - 1) (`pipeline.bubble_fraction` with v = 1).

Memory. A stage keeps only its input (b, T, D) for each microbatch between its forward and
its backward: 2 (p - 1 - s) at stage s, in a ring of 2 (p - 1) slots (per device: one stage),
plus one microbatch's recompute while its backward runs. It is 2 (p - 1), not the p - s of
1F1B run asynchronously, because every stage runs the same program each tick (vmapped over
stages, or one SPMD program): a stage cannot run a backward while its neighbour runs a
forward, so a hand-off waits for the whole forward-plus-backward tick.

Every stage runs the head each backward tick (one program for all stages; the last stage's
is the one kept): the tick takes as long as the last stage's in any case. Interleaved
(virtual) stages are not scheduled 1F1B.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from titan_jax.models.pipeline import STAGE_AXES, lead_mask, varying_like
from titan_jax.models.sharding_hooks import PipelineSplit, constrain

Array = jax.Array
# (x (b, T, D), one stage's layer params (leaves (L / p, ...)), its per-layer constants (the
# same), tables) -> (y (b, T, D), stats (L / p, ...))
StageScan = Callable[[Array, Any, Any, tuple], tuple[Array, dict[str, Array]]]
# (the last stage's output (b, T, D), the head's params, labels (b, T)) -> the summed loss
Head = Callable[[Array, Any, Array], Array]


def slots(degree: int) -> int:
    """Stage inputs a stage keeps between forward and backward (the ring's size)."""
    return 2 * (degree - 1)


def one_f_one_b_loss(
    stage_scan: StageScan,
    head: Head,
    x_BTD: Array,
    params: Any,
    consts: Any,
    tables: tuple[Array | None, ...],
    head_params: Any,
    labels_BT: Array,
    split: PipelineSplit,
) -> tuple[Array, dict[str, Array]]:
    """(the head's loss summed over the batch, every layer's statistics (L, ...) summed over
    microbatches), by the 1F1B schedule; differentiable in `x_BTD`, `params` (leaves stacked
    (L, ...); the inexact ones) and `head_params`. `consts`: per-layer inputs stacked (L, ...)
    that are not differentiated (MoE expert bias, dropout keys); `tables`: (cos, sin, segment
    ids), per position (T, H) or per token (B, T, ...), cut into microbatches with the batch."""
    p, m = split.degree, split.microbatches
    b = x_BTD.shape[0]
    if split.virtual != 1:
        raise ValueError(f"1F1B runs one chunk a stage, not {split.virtual}")
    if b % m:
        raise ValueError(f"a batch of {b} rows does not split into {m} pipeline microbatches")

    def by_stage(leaf: Array) -> Array:  # (L, ...) -> (p, L / p, ...)
        return leaf.reshape(p, leaf.shape[0] // p, *leaf.shape[1:])

    def microbatched(x: Array) -> Array:
        return x.reshape(m, b // m, *x.shape[1:])

    leaves, treedef = jax.tree.flatten(jax.tree.map(by_stage, params))
    trained = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]
    per_token = tables[0] is not None and tables[0].ndim == 3
    if per_token:
        tables = tuple(None if t is None else microbatched(t) for t in tables)
    ticks = _Ticks(stage_scan, head, split, treedef, trained, per_token)
    frozen = [leaf for leaf, t in zip(leaves, trained, strict=True) if not t]
    loss, stats = _pipelined_loss(
        ticks,
        microbatched(x_BTD),
        [leaf for leaf, t in zip(leaves, trained, strict=True) if t],
        (frozen, jax.tree.map(by_stage, consts), tables),
        head_params,
        microbatched(labels_BT),
    )
    return loss, jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), stats)


# (x (m, b, T, D), trained leaves (p, L / p, ...), (frozen leaves and constants (p, L / p, ...),
# tables), head params, labels (m, b, T))
Operands = tuple[Array, list[Array], tuple, Any, Array]


# Hand-written VJP: 1F1B runs each microbatch's backward before later microbatches' forwards,
# where autodiff's transpose of the tick scan runs every forward first. Without it:
# tests/parallel/test_pipeline.py::test_one_f_one_b_keeps_a_bounded_number_of_stage_inputs
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipelined_loss(ticks: _Ticks, *operands: Any) -> tuple[Array, dict[str, Array]]:
    """Forward only (nothing differentiates it: evaluation): m + p - 1 forward ticks."""
    return ticks.run(operands, with_grads=False)[0]


def _pipelined_loss_fwd(
    ticks: _Ticks, *operands: Any
) -> tuple[tuple[Array, dict[str, Array]], tuple]:
    return ticks.run(operands, with_grads=True)


def _pipelined_loss_bwd(ticks: _Ticks, grads: tuple, cotangents: tuple[Array, Any]) -> tuple:
    """The gradients the forward computed times the loss's cotangent (the statistics have
    none); none for the constants and labels."""
    del ticks
    dx, dw, dh = grads
    g = cotangents[0]

    def scale(grad: Array) -> Array:
        # Inside a shard_map the gradient of a weight replicated over a manual axis left the
        # forward summed over it; it is scaled by the cotangent common to those shards (the
        # step sums the shards' losses, so each shard's cotangent is the same).
        over = tuple(sorted(_varying(g) - _varying(grad)))
        common = jax.lax.pmean(g, over) if over else g
        return grad * common.astype(grad.dtype)

    return scale(dx), [scale(w) for w in dw], None, jax.tree.map(scale, dh), None


def _varying(x: Array) -> set[str]:
    """The manual mesh axes `x` varies over (none outside a shard_map)."""
    return set(jax.typeof(x).mat.varying)


_pipelined_loss.defvjp(_pipelined_loss_fwd, _pipelined_loss_bwd)


class _Ticks:
    """The schedule's ticks over one batch's microbatches (see the module docstring)."""

    def __init__(
        self,
        stage_scan: StageScan,
        head: Head,
        split: PipelineSplit,
        treedef: Any,
        trained: list[bool],
        per_token: bool,
    ):
        self.stage_scan, self.head, self.split = stage_scan, head, split
        self.treedef, self.trained, self.per_token = treedef, trained, per_token

    def _forward(
        self, x_bTD: Array, trained: list[Array], rest: tuple, i: Array | int
    ) -> tuple[Array, dict[str, Array]]:
        """One stage's layers over microbatch `i` (from its stage's slices of the operands)."""
        frozen, consts, tables = rest
        w, f = iter(trained), iter(frozen)
        params = self.treedef.unflatten([next(w) if k else next(f) for k in self.trained])
        tables = tuple(None if t is None else t[i] for t in tables) if self.per_token else tables
        return self.stage_scan(x_bTD, params, consts, tables)

    def _with_loss(
        self,
        x_bTD: Array,
        trained: list[Array],
        rest: tuple,
        head_params: Any,
        labels_MbT: Array,
        i: Array,
    ) -> tuple[Array, Array, dict[str, Array]]:
        """One stage's forward and the head's loss of its output (kept on the last stage)."""
        y_bTD, stats = self._forward(x_bTD, trained, rest, i)
        return y_bTD, self.head(y_bTD, head_params, labels_MbT[i]), stats

    def run(self, operands: Operands, with_grads: bool) -> tuple[tuple, tuple]:
        """((summed loss, statistics (p, L / p, ...)), the gradients of x, the trained leaves
        and the head's params when `with_grads`, else ())."""
        x_MbTD, trained, rest, head_params, labels_MbT = operands
        p, m = self.split.degree, self.split.microbatches
        k_slots = slots(p)
        stage = jnp.arange(p)
        last = stage == p - 1
        rest_axes = (0, 0, None)  # frozen leaves and constants per stage; tables shared

        def forward_and_loss(x_bTD: Array, w: list[Array], r: tuple, i: Array) -> tuple:
            return self._with_loss(x_bTD, w, r, head_params, labels_MbT, i)

        def backward(
            x_bTD: Array, w: list[Array], r: tuple, i: Array, g_bTD: Array, is_last: Array
        ) -> tuple:
            """Microbatch `i`'s loss and gradients on one stage, its forward recomputed from
            its input: the last stage seeds the loss, the others their output's cotangent."""

            def f(x: Array, w: list[Array], h: Any) -> tuple[Array, Array]:
                return self._with_loss(x, w, r, h, labels_MbT, i)[:2]

            (_, loss), pull = jax.vjp(f, x_bTD, w, head_params)
            seed_loss = varying_like(is_last.astype(loss.dtype), (loss,))  # typed as the loss
            seed = (jnp.where(is_last, jnp.zeros_like(g_bTD), g_bTD), seed_loss)
            return (loss, *pull(seed))

        axis = self.split.axis
        stages_fwd = jax.vmap(self._forward, in_axes=(0, 0, rest_axes, 0), spmd_axis_name=axis)
        stages_fwd_loss = jax.vmap(
            forward_and_loss, in_axes=(0, 0, rest_axes, 0), spmd_axis_name=axis
        )
        stages_bwd = jax.vmap(backward, in_axes=(0, 0, rest_axes, 0, 0, 0), spmd_axis_name=axis)

        def zeros(shape: tuple[int, ...], dtype: Any, like: tuple = (x_MbTD, *trained)) -> Array:
            """Inside a shard_map typed as varying over the manual axes `like` varies over."""
            return varying_like(jnp.zeros(shape, dtype), like)

        x0 = x_MbTD[0]
        stage0 = jax.tree.map(lambda a: a[0], (trained, rest[:2]))
        stats_shape = jax.eval_shape(
            lambda: self._forward(x0, stage0[0], (*stage0[1], rest[2]), 0)[1]
        )
        carry = {
            "x": constrain(zeros((p, *x0.shape), x0.dtype).at[0].set(x0), STAGE_AXES),
            "stats": jax.tree.map(lambda s: zeros((p, *s.shape), s.dtype), stats_shape),
            "loss": zeros((p,), jnp.float32),
        }
        if with_grads:
            carry |= {
                "g": constrain(zeros((p, *x0.shape), x0.dtype), STAGE_AXES),
                "saved": zeros((p, k_slots, *x0.shape), x0.dtype),
                # Gradients typed as their inputs (a weight replicated over a manual axis has
                # its gradient summed over it already).
                "dx": zeros(x_MbTD.shape, x_MbTD.dtype, (x_MbTD,)),
                "dw": [zeros(w.shape, w.dtype, (w,)) for w in trained],
                "dh": jax.tree.map(lambda h: zeros((p, *h.shape), h.dtype, (h,)), head_params),
            }
        at_slot = jax.vmap(lambda ring, k: ring[k])
        set_slot = jax.vmap(lambda ring, x, k: jax.lax.dynamic_update_index_in_dim(ring, x, k, 0))

        def tick(carry: dict, t: Array, fwd: bool, bwd: bool) -> tuple[dict, None]:
            carry = dict(carry)
            if bwd:
                b = t - 2 * (p - 1) + stage
                b_ok = (b >= 0) & (b < m)
                b = jnp.clip(b, 0, m - 1)
                # Microbatch b's input: saved at its forward, or (last stage) this tick's.
                saved = at_slot(carry["saved"], b % k_slots)
                x_b = jnp.where(lead_mask(last, saved), carry["x"], saved)
                loss, dx, dw, dh = stages_bwd(x_b, trained, rest, b, carry["g"], last)
                keep = b_ok & last
                carry["loss"] = carry["loss"] + jnp.where(keep, loss, 0)
                carry["dw"] = [
                    acc + jnp.where(lead_mask(b_ok, g), g, 0)
                    for acc, g in zip(carry["dw"], dw, strict=True)
                ]
                carry["dh"] = jax.tree.map(
                    lambda acc, g: acc + jnp.where(lead_mask(keep, g), g, 0), carry["dh"], dh
                )
                # Stage 0's input cotangent is the pipeline input's; the rest go a stage back.
                first = jnp.where(b_ok[0], dx[0], carry["dx"][b[0]])
                carry["dx"] = jax.lax.dynamic_update_index_in_dim(carry["dx"], first, b[0], 0)
                carry["g"] = constrain(jnp.roll(dx, -1, axis=0), STAGE_AXES)
            if fwd:
                f = t - stage
                f_ok = (f >= 0) & (f < m)
                f = jnp.clip(f, 0, m - 1)
                x_PbTD = carry["x"]
                if with_grads:
                    y, stats = stages_fwd(x_PbTD, trained, rest, f)
                    # Keep this tick's input until its backward (idle ticks keep the ring).
                    slot = f % k_slots
                    old = at_slot(carry["saved"], slot)
                    new = jnp.where(lead_mask(f_ok, old), x_PbTD, old)
                    carry["saved"] = set_slot(carry["saved"], new, slot)
                else:
                    y, loss, stats = stages_fwd_loss(x_PbTD, trained, rest, f)
                    carry["loss"] = carry["loss"] + jnp.where(f_ok & last, loss, 0)
                carry["stats"] = jax.tree.map(
                    lambda acc, s: acc + jnp.where(lead_mask(f_ok, s), s, 0),
                    carry["stats"],
                    stats,
                )
                rolled = jnp.roll(constrain(y, STAGE_AXES), 1, axis=0)
                fresh = jax.lax.dynamic_index_in_dim(
                    x_MbTD, jnp.minimum(t + 1, m - 1), 0, keepdims=False
                )
                carry["x"] = constrain(
                    jnp.where(lead_mask(stage == 0, rolled), fresh, rolled), STAGE_AXES
                )
            return carry, None

        def phase(carry: dict, start: int, stop: int, fwd: bool, bwd: bool) -> dict:
            body = lambda c, t: tick(c, t, fwd, bwd)  # noqa: E731
            return jax.lax.scan(body, carry, jnp.arange(start, stop))[0]

        if with_grads:  # warm-up: forward only; steady: both; cool-down: backward only
            carry = phase(carry, 0, p - 1, True, False)
            carry = phase(carry, p - 1, m + p - 1, True, True)
            carry = phase(carry, m + p - 1, m + 2 * (p - 1), False, True)
        else:
            carry = phase(carry, 0, m + p - 1, True, False)
        out = (jnp.sum(carry["loss"]), carry["stats"])
        if not with_grads:
            return out, ()
        dh = jax.tree.map(lambda g: jnp.sum(g, axis=0), carry["dh"])
        return out, (carry["dx"], carry["dw"], dh)
