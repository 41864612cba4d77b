"""Which layout wins across slices (or inside one): pipeline stages against data parallelism, priced
from the model's shape and the chips' published rates (`topology.Chip`, `sustained`), without a
compile.

Both layouts run the same per-chip compute (each chip's share of the batch's FLOPs), so the
comparison is in what each adds to it:
- HSDP across slices (`pp` 1, `dp_replicate` = slices): every step the fp32 gradient is
  all-reduced across slices over DCN; each chip sends 2 (S - 1) / S of its gradient shard
  (parameters x 4 bytes / chips of a slice). Each slice holds the whole model, FSDP-sharded over
  its chips.
- PP (`pp` stages, across slices when pp divides by them): the bubble, (pp - 1) / (v m + pp - 1)
  of the ticks idle (`models/pipeline.py`), i.e. the compute stretched by (pp - 1) / (v m); each
  tick every chip sends its shard of one microbatch's activations (bf16) to the next stage,
  forward and (the activation's gradient) backward, over DCN when pp spans slices; each stage's
  weights are gathered again every tick (fwd, and bwd under remat), over ICI; interleaved
  stages also move (v - 1) / v of the stored weights to their chunks' stages and the gradients
  back each step (the layers are stored in one layout, `layers` split over pp in consecutive
  blocks). Each chip holds
  1 / pp of the model's state (a stage's layers) where HSDP holds it whole in every slice.
- 1F1B (`models/one_f_one_b.py`): GPipe's placement, bubble and sends; each stage's backward
  recomputes its forward from the saved stage input, one forward more than GPipe's (2 / 6 of
  the training FLOPs on top of full remat's 8 / 6), for activation memory that does not grow
  with the batch: 2 (pp - 1) stage inputs and one microbatch's recompute of a stage's layers,
  where GPipe keeps every microbatch's layer inputs (full remat).

The times are upper bounds on what each adds: transfers are counted exposed (not overlapped with
compute), the compute at the chip's sustained matmul rate (full remat: 8 / 6 of the training
FLOPs). What a row says is which added cost is larger, and by how much.
"""

from __future__ import annotations

import dataclasses

from titan_jax.models import get_model_spec
from titan_jax.models.one_f_one_b import slots
from titan_jax.models.pipeline import bubble_fraction
from titan_jax.planner import sustained
from titan_jax.planner.topology import TpuSlice

GRAD_BYTES = 4  # fp32 gradient reductions (training.mixed_precision_reduce)
ACT_BYTES = 2  # bf16 activations between stages
STATE_BYTES = 12  # fp32 master weights + Adam's two moments per parameter
REMAT_FULL = 8 / 6  # full activation checkpointing recomputes the forward
STAGE_RECOMPUTE = 2 / 6  # 1F1B's backward recomputes each stage's forward once more


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the pricing reads of a model: its parameters, training FLOPs a token, width."""

    params: int
    flops_per_token: float
    dim: int
    layers: int

    @classmethod
    def of(cls, family: str, flavor: str, seq_len: int) -> ModelShape:
        """The shape of a registered family's flavour (`model.name`, `model.flavor`), built
        abstractly (nothing allocated)."""
        spec = get_model_spec(family)
        args = spec.flavor(flavor)
        return cls(
            spec.build(args).num_params(),
            spec.flops_per_token(args, seq_len),
            args.dim,
            args.n_layers,
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to place a run: `pp` stages (`virtual` chunks each, `microbatches` slices of the
    batch, `schedule` "gpipe", "interleaved" or "1f1b"), the rest data-parallel (FSDP inside a
    slice, HSDP's replicas across slices)."""

    pp: int = 1
    virtual: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """Seconds a step spends on compute and on what the layout adds to it, and bytes per chip."""

    compute_s: float
    bubble_s: float
    dcn_s: float  # gradient all-reduce (HSDP) or stage sends (PP over DCN), exposed
    ici_sends_s: float  # stage sends over ICI (PP inside a slice), exposed
    weight_gathers: float  # the model's weights FSDP-gathered per step, in whole models (ICI)
    state_bytes: float  # master weights + optimizer moments per chip
    bubble_fraction: float  # of the ticks, idle
    activation_bytes: float  # layer inputs (bf16) kept between forward and backward, per chip

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.dcn_s + self.ici_sends_s


def layout_cost(
    model: ModelShape, tpu: TpuSlice, tokens_per_chip: int, layout: Layout, rows_per_rank: int
) -> LayoutCost:
    """The cost of `layout` for `model` on `tpu` (all its slices), each chip holding
    `tokens_per_chip` tokens of the step's batch and each data-parallel rank `rows_per_rank`
    rows, as the same batch data-parallel would. Under PP a rank spans pp chips, one a stage,
    and holds pp x the rows; the trainer cuts them into microbatches of whole rows, so
    `layout.microbatches` must be at least pp and divide them (a ValueError otherwise)."""
    if layout.pp > 1:
        rows = layout.pp * rows_per_rank
        m = layout.microbatches
        if m < layout.pp or rows % m:
            raise ValueError(
                f"{m} microbatches of {rows} rows a data-parallel rank at pp {layout.pp}: the "
                "trainer needs at least pp microbatches of whole rows"
            )
    chip, slices = tpu.chip, tpu.num_slices
    chips = tpu.chips * slices * chip.devices_per_chip
    params, dim = model.params, model.dim
    recompute = REMAT_FULL + (STAGE_RECOMPUTE if layout.schedule == "1f1b" else 0)
    flops = model.flops_per_token * tokens_per_chip * recompute
    # The rate of a (tokens x dim) x (dim x dim) matmul, the size of the model's projections.
    rate = chip.peak_bf16_flops * sustained.matmul_share(
        chip.generation, 2 * tokens_per_chip * dim * dim
    )
    compute = flops / rate
    pp, v, m = layout.pp, layout.virtual, layout.microbatches
    # The ticks stretch the compute by (v m + pp - 1) / (v m): idle (pp - 1) / (v m + pp - 1)
    # of the step, `models.pipeline.bubble_fraction`.
    bubble = compute * (pp - 1) / (v * m)
    dcn_per_chip = chip.dcn_bytes_per_s
    ici_ring = chip.ring_bytes_per_s()
    dcn = ici_sends = 0.0
    if pp == 1:
        # HSDP across slices: the gradient shard of each chip all-reduced across the slices.
        if slices > 1:
            shard = params * GRAD_BYTES / (tpu.chips * chip.devices_per_chip)
            dcn = 2 * (slices - 1) / slices * shard / dcn_per_chip
        regather = 1.0  # FSDP inside the slice: the whole model gathered once (fwd + bwd)
        state = params * STATE_BYTES / (chips / slices)
    else:
        ticks = v * m + pp - 1
        # A stage's chips hold pp x the tokens of a data-parallel chip; one microbatch a tick.
        send = pp * tokens_per_chip / m * dim * ACT_BYTES
        sends = 2 * ticks * send
        # Interleaved: the stored layers are split over pp in consecutive blocks, the chunks
        # are placed round-robin, so each step (v - 1) / v of every chip's weight shard (fp32)
        # moves to its chunk's stage and its gradient back.
        sends += 2 * (v - 1) / v * params * GRAD_BYTES / chips
        if slices > 1 and pp % slices == 0:
            dcn = sends / dcn_per_chip
        else:
            ici_sends = sends / ici_ring
        # Each tick gathers one chunk (1 / (pp v) of the model), forward and backward.
        regather = ticks / (pp * v)
        state = params * STATE_BYTES / chips
    return LayoutCost(
        compute,
        bubble,
        dcn,
        ici_sends,
        regather,
        state,
        bubble_fraction(pp, v, m),
        activation_bytes(model, tokens_per_chip, layout),
    )


def activation_bytes(model: ModelShape, tokens_per_chip: int, layout: Layout) -> float:
    """Per chip, the layer inputs (bf16, full remat) a step keeps between forward and backward:
    every layer's for every token of the stage's chip (no PP, GPipe, interleaved: all of the
    batch's microbatches wait for backward); under 1F1B 2 (pp - 1) stage inputs and one
    microbatch's layer inputs through the stage's layers (its recompute), whatever the batch.
    The bubble of 1F1B is GPipe's: (pp - 1) / (m + pp - 1)."""
    pp, m = layout.pp, layout.microbatches
    per_token = model.dim * ACT_BYTES
    if layout.schedule != "1f1b":
        # A stage's chips hold pp x a data-parallel chip's tokens, for L / pp layers.
        return model.layers * tokens_per_chip * per_token
    microbatch = pp * tokens_per_chip / m
    return (slots(pp) + model.layers / pp) * microbatch * per_token
