# ruff: noqa: E501 (HLO text keeps its lines whole)
"""The published sustained rates (planner/sustained.py) and the estimate's use of them
(planner/hlo_cost.py: matmuls by size, host transfers over the host link)."""

from __future__ import annotations

import pytest

from titan_jax.planner import hlo_cost, sustained
from titan_jax.planner.sustained import Curve
from titan_jax.planner.topology import Chip

# 1 TFLOP/s; HBM fast enough (1 TB/s) not to bound these programs: seconds read as TFLOPs.
CHIP = Chip("test", 1e12, 2**40, 1e12, 2e9, 1e9, 1, "test")


def test_a_curve_interpolates_in_log_size_and_holds_its_end_points_outside():
    curve = Curve(((1024, 0.3), (4096, 0.7)), "test")
    assert curve(1024) == 0.3 and curve(4096) == 0.7
    assert curve(2048) == pytest.approx(0.5)  # halfway in log2: 10 -> 12
    assert curve(1024 * 2**0.5) == pytest.approx(0.4)
    assert curve(1) == 0.3 and curve(10**9) == 0.7  # no extrapolation
    with pytest.raises(ValueError, match="ascending"):
        Curve(((4096, 0.7), (1024, 0.3)), "test")


def test_each_chip_reads_its_published_curve_and_v5p_borrows_v5es():
    cube = lambda side: 2.0 * side**3  # noqa: E731  (FLOPs of an m=n=k matmul)
    assert sustained.matmul_share("tpu7x", cube(4096)) == pytest.approx(0.774)
    assert sustained.matmul_share("tpu7x", cube(512)) == pytest.approx(0.091)
    # between 2048 (58.9%) and 4096 (77.4%): log2(3000 / 2048) = 0.5507 of the way
    assert sustained.matmul_share("tpu7x", cube(3000)) == pytest.approx(
        0.589 + (0.774 - 0.589) * 0.5507, rel=1e-4
    )
    assert (
        sustained.matmul_share("v6e", cube(256))
        == sustained.matmul_share("v6e", cube(65536))
        == 0.901
    )
    assert sustained.matmul_share("v5p", cube(8192)) == sustained.matmul_share("v5e", cube(8192))
    assert sustained.matmul_share("v5p", cube(8192)) == pytest.approx(0.923)
    assert sustained.hbm_share("tpu7x", 2 * 8 * 2**30) == pytest.approx(0.870)
    assert sustained.hbm_share("tpu7x", 2 * 2 * 2**20) == pytest.approx(0.374)
    assert sustained.hbm_share("v5p", 1e6) == 0.845
    assert sustained.collective_share("v5p", 1.6e6) == pytest.approx(0.401, rel=0.01)
    assert sustained.collective_share("v5p", 1e9) == 1.0
    assert sustained.matmul_share("test", 1e12) == sustained.hbm_share("test", 1) == 1.0


DOT = """
HloModule m, is_scheduled=true

ENTRY %main (a: bf16[1000,1000], b: bf16[1000,500000]) -> bf16[1000,500000] {
  %a = bf16[1000,1000]{1,0:S(1)} parameter(0)
  %b = bf16[1000,500000]{1,0:S(1)} parameter(1)
  ROOT %d = bf16[1000,500000]{1,0:S(1)} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_matmul_runs_at_the_share_of_peak_its_size_sustains(monkeypatch):
    assert hlo_cost.estimate(DOT, CHIP, 1)["step_s"] == pytest.approx(1.0)  # 1 TFLOP at peak
    monkeypatch.setitem(sustained.MATMUL, "test", Curve(((100, 0.5), (10**6, 0.8)), "test"))
    # (1000 x 1000 x 500000)^(1/3) = 7937: 0.5 + 0.3 x log(79.37) / log(10^4)
    share = 0.5 + 0.3 * 0.4749
    assert hlo_cost.estimate(DOT, CHIP, 1)["step_s"] == pytest.approx(1 / share, rel=1e-3)


# A layer's value offloaded to host memory (S(5)) as XLA:TPU compiles it: an async
# dynamic-update-slice of a 0.5 GB piece into a host buffer, started before a dot of
# `flops` TFLOPs and waited for after it; optionally a second transfer started beside it,
# the same way or the other (an async dynamic-slice reading a piece back).
OFFLOAD = """
HloModule m, is_scheduled=true

%to_host (p0: bf16[4,250000000], p1: bf16[1,250000000], p2: s32[]) -> bf16[4,250000000] {{
  %p0 = bf16[4,250000000]{{1,0:S(5)}} parameter(0)
  %p1 = bf16[1,250000000]{{1,0}} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[4,250000000]{{1,0:S(5)}} dynamic-update-slice(%p0, %p1, %p2, %z)
}}

%from_host (p0: bf16[4,250000000], p1: s32[]) -> bf16[1,250000000] {{
  %p0 = bf16[4,250000000]{{1,0:S(5)}} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,250000000]{{1,0}} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={{1,250000000}}
}}

ENTRY %main (host: bf16[4,250000000], x: bf16[1,250000000], y: bf16[1,250000000], i: s32[], a: bf16[1000,1000], b: bf16[1000,{n}]) -> bf16[1000,{n}] {{
  %host = bf16[4,250000000]{{1,0:S(5)}} parameter(0)
  %x = bf16[1,250000000]{{1,0}} parameter(1)
  %y = bf16[1,250000000]{{1,0}} parameter(2)
  %i = s32[]{{:S(2)}} parameter(3)
  %a = bf16[1000,1000]{{1,0:S(1)}} parameter(4)
  %b = bf16[1000,{n}]{{1,0:S(1)}} parameter(5)
  %s0 = ((bf16[4,250000000]{{1,0:S(5)}}, bf16[1,250000000]{{1,0}}, s32[]), bf16[4,250000000]{{1,0:S(5)}}, u32[]{{:S(2)}}) async-start(%host, %x, %i), calls=%to_host
  {second_start}
  %d = bf16[1000,{n}]{{1,0:S(1)}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %w0 = bf16[4,250000000]{{1,0:S(5)}} async-done(%s0)
  {second_done}
}}
"""
SECOND = {
    "out": (
        "%s1 = ((bf16[4,250000000]{1,0:S(5)}, bf16[1,250000000]{1,0}, s32[]), bf16[4,250000000]{1,0:S(5)}, u32[]{:S(2)}) async-start(%host, %y, %i), calls=%to_host",
        "%w1 = bf16[4,250000000]{1,0:S(5)} async-done(%s1)",
    ),
    "back": (
        "%s1 = ((bf16[4,250000000]{1,0:S(5)}, s32[]), bf16[1,250000000]{1,0}, u32[]{:S(2)}) async-start(%host, %i), calls=%from_host",
        "%w1 = bf16[1,250000000]{1,0} async-done(%s1)",
    ),
    None: ("", ""),
}


@pytest.mark.parametrize(
    ("tflops", "second", "waits"),
    [
        (0.25, None, 0.25),  # 0.5 GB at 1 GB/s: 0.5 s, 0.25 s of it under the dot
        (1.0, None, 0.0),  # all of it under the dot
        (0.75, "out", 0.25),  # two transfers share the way out: the second arrives at 1 s
        (0.25, "back", 0.25),  # one each way: side by side, both arrive at 0.5 s
    ],
)
def test_host_transfers_cross_the_host_link_hidden_only_by_the_work_scheduled_under_them(
    monkeypatch, tflops, second, waits
):
    monkeypatch.setitem(sustained.HOST_LINK_BYTES_PER_S, "test", 1e9)
    text = OFFLOAD.format(
        n=int(tflops * 1e12 / 2e6), second_start=SECOND[second][0], second_done=SECOND[second][1]
    )
    r = hlo_cost.estimate(text, CHIP, 1)
    assert r["host_transfer_bytes_per_chip"] == pytest.approx((2 if second else 1) * 0.5e9)
    assert r["seconds_by_class"].get("waiting on host transfers", 0.0) == pytest.approx(waits)
    # the pieces' HBM reads (0.5 GB each at 1 TB/s) hide under the dot
    assert r["step_s"] == pytest.approx(tflops + waits, rel=1e-6)
