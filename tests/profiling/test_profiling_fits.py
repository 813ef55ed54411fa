"""The fit that turns measured link medians into the model's L + G/BW."""

from __future__ import annotations

import pytest

from lightning_distplan.profiling._links import _fit


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
