"""straggler.py: pure detection rule, and the cross-rank gather on 2 gloo processes."""

from __future__ import annotations

import pytest

from launcher.runtime.straggler import find_stragglers, gather_times
from tests.helpers.dist import run_distributed


def test_no_stragglers_when_even():
    assert find_stragglers([1.0, 1.05, 0.98, 1.1], [0.1, 0.1, 0.11, 0.1], 1.2) == []


def test_slow_step_and_slow_data_are_named():
    out = find_stragglers([1.0, 1.0, 2.0, 1.0], [0.1, 0.5, 0.1, 0.1], 1.2)
    assert [(s["rank"], s["slow"]) for s in out] == [(1, ["data_time"]), (2, ["step_time"])]
    assert out[1]["step_time"] == 2.0 and out[1]["median_step_time"] == 1.0
    assert out[1]["step_ratio"] == pytest.approx(2.0)
    assert out[0]["data_ratio"] == pytest.approx(5.0)


def test_both_measures_on_one_rank_and_zero_median():
    out = find_stragglers([1.0, 3.0, 1.0], [0.0, 0.0, 0.0], 1.5)
    assert out == [{"rank": 1, "step_time": 3.0, "data_time": 0.0, "median_step_time": 1.0,
                    "median_data_time": 0.0, "slow": ["step_time"], "step_ratio": 3.0,
                    "data_ratio": 0.0}]
    out = find_stragglers([1.0, 3.0, 1.0], [0.2, 0.9, 0.2], 1.5)
    assert out[0]["slow"] == ["step_time", "data_time"]


def test_exactly_at_threshold_is_not_slow_and_bad_inputs():
    assert find_stragglers([1.0, 1.2, 1.0], [0.0, 0.0, 0.0], 1.2) == []
    assert find_stragglers([], [], 1.2) == []
    with pytest.raises(ValueError, match="step times"):
        find_stragglers([1.0], [], 1.2)
    with pytest.raises(ValueError, match="threshold"):
        find_stragglers([1.0], [1.0], 0.0)


def test_gather_without_group_is_local():
    assert gather_times(1.5, 0.25) == ([1.5], [0.25])


def gather_worker(args: dict) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    steps, datas = gather_times(1.0 + rank * 2.0, 0.1 * (rank + 1))
    return {"steps": steps, "datas": datas, "stragglers": find_stragglers(steps, datas, 1.2)}


@pytest.mark.slow
def test_gather_times_two_ranks():
    results = run_distributed("tests.test_runtime_straggler:gather_worker", 2, timeout=90)
    assert results[0] == results[1]
    assert results[0]["steps"] == [1.0, 3.0]
    assert results[0]["datas"] == pytest.approx([0.1, 0.2])
    assert [s["rank"] for s in results[0]["stragglers"]] == [1]
