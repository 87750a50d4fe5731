"""The median and spread the benchmark tables print: median and 20th-80th percentile of the repeats."""

from __future__ import annotations

import statistics


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, 20th percentile, 80th percentile), interpolated between the measured values."""
    q = statistics.quantiles(values, n=5, method="inclusive") if len(values) > 1 else [values[0]] * 4
    return statistics.median(values), q[0], q[-1]


def cell(values: list[float], digits: int = 1) -> str:
    """'median [p20-p80]' of `values`, right-aligned median."""
    median, low, high = median_spread(values)
    return f"{median:>7.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"
