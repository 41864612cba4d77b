"""The PP-against-HSDP pricing (titan_jax/planner/pipeline_cost.py) on the recipes users ask
about: what each layout adds to the same compute."""

from __future__ import annotations

import pytest

from titan_jax.planner.pipeline_cost import Layout, ModelShape, layout_cost
from titan_jax.planner.topology import parse_slice

BIG = ModelShape.of("qwen3", "235B-A22B", 4096)


def test_hsdp_across_slices_pays_the_gradient_over_dcn():
    one = layout_cost(BIG, parse_slice("v5p-256", 1), 4096, Layout(), 1)
    two = layout_cost(BIG, parse_slice("v5p-256", 2), 4096, Layout(), 1)
    assert one.dcn_s == 0 and one.bubble_s == 0
    # 2 (S-1)/S of each chip's fp32 gradient shard (params x 4 / 128 chips) at 6.25 GB/s
    shard = 4 * BIG.params / 128
    assert two.dcn_s == pytest.approx(shard / 6.25e9, rel=0.01)
    assert two.compute_s == one.compute_s and two.state_bytes == one.state_bytes


def test_pp_across_slices_sends_activations_and_halves_the_state():
    """At 4 rows of 4096 a data-parallel rank: 8 rows a rank at pp 2, 8 microbatches."""
    tpu = parse_slice("v5p-256", 2)
    hsdp = layout_cost(BIG, tpu, 4 * 4096, Layout(), 4)
    pp = layout_cost(BIG, tpu, 4 * 4096, Layout(2, 1, 8), 4)
    assert pp.bubble_fraction == pytest.approx(1 / 9)
    assert pp.bubble_s == pytest.approx(pp.compute_s / 8)  # stretched by (v m + pp - 1) / (v m)
    assert pp.dcn_s < hsdp.dcn_s / 10  # activations, not gradients, cross the slices
    assert pp.state_bytes == pytest.approx(hsdp.state_bytes / 2)
    assert pp.weight_gathers == pytest.approx(9 / 2)  # each of 9 ticks gathers half the model


@pytest.mark.parametrize("microbatches", [1, 3, 4])
def test_only_microbatches_of_whole_rows_the_trainer_runs_are_priced(microbatches):
    """One row a data-parallel rank, 2 at pp 2: the trainer cuts them into 2 microbatches at
    most, and at least pp (a quarter of a row is not a microbatch it can run)."""
    with pytest.raises(ValueError, match="at least pp microbatches of whole rows"):
        layout_cost(BIG, parse_slice("v5p-256", 2), 4096, Layout(2, 1, microbatches), 1)
    assert layout_cost(BIG, parse_slice("v5p-256", 2), 4096, Layout(2, 1, 2), 1).step_s > 0


def test_pp_inside_one_slice_only_adds():
    tpu = parse_slice("v5p-32", 1)
    model = ModelShape.of("qwen3", "32B", 4096)
    plain = layout_cost(model, tpu, 4096, Layout(), 4)
    for layout in (Layout(2, 1, 8), Layout(2, 2, 8)):
        pp = layout_cost(model, tpu, 4096, layout, 4)
        assert pp.dcn_s == 0 and pp.ici_sends_s > 0 and pp.step_s > plain.step_s
        assert pp.state_bytes == plain.state_bytes


def test_one_f_one_b_has_gpipes_bubble_and_activations_that_shrink_with_microbatches():
    """1F1B's bubble and sends are GPipe's; it recomputes each stage once more (2 / 6 of the
    training FLOPs over full remat's 8 / 6) and keeps 2 (pp - 1) stage inputs plus one
    microbatch's recompute, where GPipe keeps every layer input of the batch."""
    tpu = parse_slice("v5p-256", 2)
    tokens = 16 * 4096  # 16 rows a data-parallel rank, 32 at pp 2
    gpipe = layout_cost(BIG, tpu, tokens, Layout(2, 1, 16), 16)
    f1b = layout_cost(BIG, tpu, tokens, Layout(2, 1, 16, "1f1b"), 16)
    assert f1b.bubble_fraction == gpipe.bubble_fraction and f1b.dcn_s == gpipe.dcn_s
    assert f1b.compute_s == pytest.approx(gpipe.compute_s * 10 / 8)
    layer_input = tokens * BIG.dim * 2  # a data-parallel chip's tokens, bf16
    assert gpipe.activation_bytes == pytest.approx(BIG.layers * layer_input)
    microbatch = 2 * layer_input / 16  # a stage's chip holds 2 x the tokens, in 16 microbatches
    assert f1b.activation_bytes == pytest.approx((2 + BIG.layers / 2) * microbatch)
    more = layout_cost(BIG, tpu, tokens, Layout(2, 1, 32, "1f1b"), 16)
    assert more.activation_bytes == pytest.approx(f1b.activation_bytes / 2)
