"""format_ms: the one millisecond formatter of the logs and reports."""

from __future__ import annotations

import pytest

from lightning_distplan._format import format_ms


@pytest.mark.parametrize(
    ("seconds", "decimals", "printed"),
    [
        # under 1 ms: 3 significant figures, never "0.00" / "0.0" for a time that is not 0
        (4.2e-6, 2, "0.00420"), (4.2e-6, 1, "0.00420"), (9.6e-6, 1, "0.00960"), (1.23456e-4, 2, "0.123"), (9.99e-4, 1, "0.999"),
        # from 1 ms up: the fixed decimals the printers had
        (0.0123456, 2, "12.35"), (0.0123456, 1, "12.3"), (0.001, 1, "1.0"), (1.5, 2, "1500.00"), (0.1, 1, "100.0"),
        (0.0, 2, "0.00"),
    ],
)
def test_a_nonzero_time_prints_nonzero_and_ordinary_times_as_before(seconds: float, decimals: int, printed: str) -> None:
    assert format_ms(seconds, decimals) == printed
