"""Fewer points for a long series, keeping every extreme: :func:`keep_extremes`.

A 1,000,000-step run cannot put a million points into every chart of a page. The series is cut
into buckets of consecutive points and each bucket keeps its first, last, smallest and largest
point (the M4 scheme of Jugel et al., VLDB 2014: a line drawn through them at the chart's width
looks like the full line). So the first and last point, the global minimum and maximum and every
spike survive; the points kept are a subset of the series, never averaged.
"""

from __future__ import annotations

from typing import Optional, Sequence

DEFAULT_MAX_POINTS = 4000
"""Points per series in a chart: about four per horizontal pixel of a wide chart."""


def keep_extremes(values: Sequence[Optional[float]], max_points: int = DEFAULT_MAX_POINTS) -> list:
    """Indices into ``values`` to keep (ascending): all of them when there are at most
    ``max_points``, else per bucket the first, last, minimum and maximum (missing and
    non-finite values are never a bucket's minimum or maximum, but a bucket's first and last
    index are kept whatever they hold, so gaps stay visible)."""
    import numpy as np

    n = len(values)
    if n <= max_points:
        return list(range(n))
    buckets = max(1, max_points // 4)
    size = -(-n // buckets)
    arr = np.full(buckets * size, np.nan)
    arr[:n] = [np.nan if v is None else v for v in values]
    arr[~np.isfinite(arr)] = np.nan
    rows = arr.reshape(buckets, size)
    starts = np.arange(buckets) * size
    live = starts < n
    keep = set(starts[live].tolist()) | set(np.minimum(starts + size, n)[live] - 1)
    finite = ~np.all(np.isnan(rows), axis=1)
    filled_low = np.where(np.isnan(rows), np.inf, rows)
    filled_high = np.where(np.isnan(rows), -np.inf, rows)
    for column in (filled_low.argmin(axis=1), filled_high.argmax(axis=1)):
        keep.update((starts + column)[finite].tolist())
    return sorted(int(i) for i in keep if i < n)


def thin(xs: Sequence, ys: Sequence, max_points: int = DEFAULT_MAX_POINTS) -> tuple[list, list]:
    """(xs, ys) at the indices :func:`keep_extremes` keeps for ``ys``."""
    idx = keep_extremes(ys, max_points)
    return [xs[i] for i in idx], [ys[i] for i in idx]
