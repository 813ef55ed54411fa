"""The fit that turns measured link medians into the model's L + G/BW."""

from __future__ import annotations

import pytest

from lightning_distplan.profiling._links import _fit, _keep_faster


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


def test_slow_first_small_message_reading_is_replaced_by_the_faster_retiming():
    # Sweep O, demo_transformer at 100 Mbit/s: every 4 KiB ping-pong took 1.96 ms in the first
    # reading (p2p L 1.6 ms against the all-reduce's 0.16 ms per step), the other sizes were normal.
    sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
    first = [0.00196, 0.00442, 0.08671, 0.34984, 1.3986]
    _, (slow_latency, _) = _fit(sizes, first)
    assert slow_latency > 1.5e-3
    # timed again (4 KiB and 64 KiB): 4 KiB normal now, 64 KiB a little slower than before
    kept = _keep_faster(sizes, first, {1 << 12: 0.00018, 1 << 16: 0.0046})
    assert kept == [0.00018, 0.00442, 0.08671, 0.34984, 1.3986]
    _, (latency, inv_bw) = _fit(sizes, kept)
    assert 0 < latency < 2e-4
    assert 1 / inv_bw * 8 == pytest.approx(96e6, rel=0.05)  # the bandwidth is untouched


def test_one_stalled_large_median_does_not_flatten_the_line_below_the_largest_message():
    # Like the 2-rank gloo all-reduce on a busy CI host whose fit put a 4 MiB message that took
    # 4.0 ms at 0.74 ms: the 1 MiB median stalled to 3.6 ms, so the top-half slope alone was ~0.
    sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    times = [2e-4, 3e-4, 3.6e-3, 4.0e-3]
    line, (latency, inv_bw) = _fit(sizes, times)
    assert line.beta + line.alpha * sizes[-1] == pytest.approx(times[-1], rel=1e-9)  # the smallest-to-largest slope
    assert inv_bw == pytest.approx((times[-1] - times[0]) / (sizes[-1] - sizes[0]), rel=1e-9)
    assert latency == pytest.approx(times[0] - sizes[0] * inv_bw, rel=1e-9) and latency > 0


@pytest.mark.parametrize("sizes", [(6, 4096), (4096, 4097), (4096,), (0, 4096)])
def test_link_sizes_that_are_not_whole_float32_messages_are_refused_before_any_process_group(sizes):
    """The messages are float32 tensors of n // 4 values, so 6 bytes went out as 4 and were fitted as 6. Refused on
    every call, also where no process group exists (it returned () without looking at the sizes)."""
    from lightning_distplan.profiling import ProfilingError, measure_links

    with pytest.raises(ProfilingError, match=r"positive multiples of 4 bytes.*HINT"):
        measure_links(sizes_bytes=sizes)
    assert measure_links(sizes_bytes=(4096, 8192)) == ()  # valid sizes, not distributed: nothing to measure
