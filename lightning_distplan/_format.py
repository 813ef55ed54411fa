"""Numbers as the logs and reports print them, one formatter each, so that no printer rounds a nonzero time to zero."""

from __future__ import annotations

__all__ = ["format_ms"]


def format_ms(seconds: float, decimals: int = 2) -> str:
    """``seconds`` in milliseconds (no unit): ``decimals`` decimals from 1 ms up, 3 significant figures below.

    Fixed decimals alone print a step under 5 µs as "0.00" (a tiny model: "predicted 0.00 ms/step", a forward pass of
    "0.0 ms"), which reads as no time at all. From 1 ms up the decimals already give 2 significant figures or more
    (``decimals`` >= 1), so those times print as fixed decimals would.

    Example:
        >>> format_ms(0.0123456), format_ms(0.0123456, 1), format_ms(1.23456e-4), format_ms(4.2e-6, 1), format_ms(0.0)
        ('12.35', '12.3', '0.123', '0.00420', '0.00')
    """
    ms = seconds * 1e3
    return f"{ms:.{decimals}f}" if abs(ms) >= 1 else f"{ms:#.3g}"
