"""The median and spread the benchmark tables print: median and 20th-80th percentile of the repeats; and the median
decode step of a streamed `generate` call."""

from __future__ import annotations

import itertools
import statistics


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, 20th percentile, 80th percentile), interpolated between the measured values."""
    q = statistics.quantiles(values, n=5, method="inclusive") if len(values) > 1 else [values[0]] * 4
    return statistics.median(values), q[0], q[-1]


def cell(values: list[float], digits: int = 1) -> str:
    """'median [p20-p80]' of `values`, right-aligned median."""
    median, low, high = median_spread(values)
    return f"{median:>7.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def median_step(times: list[float]) -> float:
    """The median time between two streamed tokens after the first (which follows the prefill), from the times at
    which the new tokens arrived."""
    return statistics.median(b - a for a, b in itertools.pairwise(times[1:]))
