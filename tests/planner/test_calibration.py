"""The step-time estimate against published hardware step times, and the band every printed
estimate carries from it (planner/calibration.py)."""

from __future__ import annotations

import pytest

from titan_jax.planner import calibration


def test_the_band_is_the_calibrations_worst_residuals_above_and_below(monkeypatch):
    points = (
        calibration.Point("fast", 1.2, 1.0, "x"),
        calibration.Point("slow", 0.9, 1.0, "y"),
        calibration.Point("exact", 2.0, 2.0, "z"),
    )
    monkeypatch.setattr(calibration, "POINTS", points)
    assert calibration.residuals() == pytest.approx((-0.1, 0.2))
    assert calibration.step_band(3.0) == pytest.approx((2.7, 3.6))
    assert calibration.mfu_band(48.0) == pytest.approx((40.0, 48.0 / 0.9))
    assert calibration.with_band(3.0, 48.0) == "3.00 s (2.70-3.60 s) / 48% (40-53%)"
    assert calibration.with_band(3.0) == "3.00 s (2.70-3.60 s)"
    assert calibration.Point("fast", 1.2, 1.0, "x").residual == pytest.approx(0.2)


def test_the_band_stops_at_the_roofline_bound(monkeypatch):
    """A measured step can beat the estimate by the calibration's worst residual, but not the
    roofline bound (compute at peak, collectives hidden): the band stops there."""
    points = (calibration.Point("fast", 1.2, 1.0, "x"), calibration.Point("slow", 0.5, 1.0, "y"))
    monkeypatch.setattr(calibration, "POINTS", points)
    assert calibration.step_band(3.0) == pytest.approx((1.5, 3.6))
    assert calibration.step_band(3.0, floor_s=2.0) == pytest.approx((2.0, 3.6))
    assert calibration.mfu_band(40.0, ceiling=60.0) == pytest.approx((40.0 / 1.2, 60.0))
    # MFU 40% with a 60% roofline: the roofline step is 3.0 x 40 / 60 = 2.0 s.
    assert calibration.with_band(3.0, 40.0, 60.0) == "3.00 s (2.00-3.60 s) / 40% (33-60%)"
    # int8 matmuls beat a roofline at bf16's peak: no bound, the residuals' band
    assert calibration.with_band(3.0, 90.0, 60.0) == "3.00 s (1.50-3.60 s) / 90% (75-180%)"


def test_each_point_quotes_the_step_time_its_source_published():
    """A point's measured step time is the one its source states (a typo in either shows)."""
    for point in calibration.POINTS:
        quoted = {f"{point.measured_step_s:.{d}f} s" for d in (2, 3)}
        assert any(q in point.source for q in quoted), (point.name, point.source)
        assert point.estimated_step_s > 0


def test_the_shipped_band_brackets_every_point():
    low, high = calibration.residuals()
    for point in calibration.POINTS:
        lo, hi = calibration.step_band(point.estimated_step_s)
        assert lo <= point.measured_step_s + 1e-9 and point.measured_step_s <= hi + 1e-9
    assert low <= high
