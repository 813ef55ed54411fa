"""The fits that turn profiled medians into model parameters: weighted least squares and the link's L + G/BW."""

from __future__ import annotations

import pytest

from lightning_distplan.profile import LinearFit
from lightning_distplan.profiling._links import _fit


def test_weighted_fit_equals_ordinary_with_equal_weights_and_rejects_bad_weights():
    xs, ys = [1, 2, 4, 8], [3.0, 5.2, 8.9, 17.1]
    a, b = LinearFit.fit(xs, ys), LinearFit.fit(xs, ys, weights=[2.0] * 4)
    assert (a.alpha, a.beta, a.r2) == pytest.approx((b.alpha, b.beta, b.r2))
    with pytest.raises(ValueError, match="weight"):
        LinearFit.fit(xs, ys, weights=[1.0, -1.0, 1.0, 1.0])


def test_link_fit_takes_bandwidth_from_large_and_latency_from_small_messages():
    # A tc tbf link at 1 Gbit/s with a 128 KiB burst (measured p2p medians, s): messages up to the
    # burst pass at veth speed, so one line through all points would double the bandwidth or
    # inflate the latency. The two-regime fit recovers both.
    sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    times = [0.000173, 0.000242, 0.008054, 0.034384]
    line, (latency, inv_bw) = _fit(sizes, times)
    assert 1 / inv_bw * 8 == pytest.approx(0.96e9, rel=0.05)  # the shaped rate, not veth speed
    assert latency == pytest.approx(0.000173 - (1 << 12) * inv_bw, rel=1e-9) and 0 < latency < 0.0002
    assert line.r2 > 0.99
