"""Straggler detection: compare every rank's step time and data-wait time with the median.

Every ``trainer.straggler_interval`` steps all ranks call :func:`gather_times` (a collective);
rank 0 passes the lists to :func:`find_stragglers` and logs one ``straggler`` event per slow rank.
A slow step time points at a slow GPU, host or link; a slow data-wait time at a slow filesystem or
too few data-loader workers on that host.
"""

from __future__ import annotations

import statistics
from typing import Any, List, Tuple


def _slow_ranks(values: List[float], threshold: float) -> Tuple[float, List[int]]:
    """Median of ``values`` and the ranks above ``threshold`` x median."""
    median = statistics.median(values)
    return median, [rank for rank, v in enumerate(values) if median > 0 and v > threshold * median]


def find_stragglers(step_times: List[float], data_times: List[float],
                    threshold: float) -> List[dict]:
    """Ranks slower than ``threshold`` x the median step time or data-wait time.

    ``step_times[r]`` and ``data_times[r]`` are rank r's seconds (per step, or summed over the
    same window on every rank). Returns one dict per slow rank, in rank order::

        {"rank": 3, "step_time": 1.9, "data_time": 0.02, "median_step_time": 1.0,
         "median_data_time": 0.02, "slow": ["step_time"], "step_ratio": 1.9, "data_ratio": 1.0}

    A median of zero (e.g. no data wait anywhere) flags nobody for that measure.
    """
    if len(step_times) != len(data_times):
        raise ValueError(f"{len(step_times)} step times but {len(data_times)} data times")
    if not threshold > 0:
        raise ValueError(f"straggler threshold must be a positive multiple of the median "
                         f"(e.g. 1.2), got {threshold}")
    if not step_times:
        return []
    step_median, slow_step = _slow_ranks(step_times, threshold)
    data_median, slow_data = _slow_ranks(data_times, threshold)
    out = []
    for rank in sorted(set(slow_step) | set(slow_data)):
        out.append({
            "rank": rank, "step_time": step_times[rank], "data_time": data_times[rank],
            "median_step_time": step_median, "median_data_time": data_median,
            "slow": [name for name, ranks in (("step_time", slow_step), ("data_time", slow_data))
                     if rank in ranks],
            "step_ratio": step_times[rank] / step_median if step_median else 0.0,
            "data_ratio": data_times[rank] / data_median if data_median else 0.0,
        })
    return out


def gather_times(step_time: float, data_time: float,
                 group: Any = None) -> Tuple[List[float], List[float]]:
    """Every rank's (step_time, data_time), indexed by rank; a collective on all ranks.

    Without an initialised process group the lists hold only this process's values."""
    from launcher.parallel import collectives

    rows = collectives.gather_floats([step_time, data_time], group)
    return [r[0] for r in rows], [r[1] for r in rows]
