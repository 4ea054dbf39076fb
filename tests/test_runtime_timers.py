"""timers.py: phase sums, stable keys, sync before each clock reading, fused-phase renaming."""

from __future__ import annotations

import time

import pytest

from launcher.core.phases import PHASES, PhaseTimer


def test_phases_sum_and_every_key_present():
    timer = PhaseTimer()
    for _ in range(3):
        with timer.phase("forward"):
            time.sleep(0.01)
    timer.add("data", 0.5)
    timer.add("data", 0.25)
    snap = timer.snapshot()
    assert set(snap) == set(PHASES)
    assert snap["data"] == pytest.approx(0.75)
    assert 0.03 <= snap["forward"] < 0.5
    assert snap["optimizer"] == 0.0 and snap["checkpoint"] == 0.0
    assert timer.snapshot() == {name: 0.0 for name in PHASES}  # reset by the first snapshot


def test_snapshot_without_reset_keeps_totals():
    timer = PhaseTimer()
    timer.add("loss", 1.0)
    assert timer.snapshot(reset=False)["loss"] == 1.0
    timer.add("loss", 1.0)
    assert timer.total() == 2.0
    assert timer.snapshot()["loss"] == 2.0


def test_phase_counts_time_when_block_raises():
    timer = PhaseTimer()
    with pytest.raises(RuntimeError):
        with timer.phase("optimizer"):
            time.sleep(0.01)
            raise RuntimeError("boom")
    assert timer.snapshot()["optimizer"] >= 0.01


def test_sync_called_before_each_reading():
    calls = []
    timer = PhaseTimer(sync=lambda: calls.append(time.perf_counter()))
    with timer.phase("backward"):
        pass
    assert len(calls) == 2


def test_sync_time_is_charged_to_the_phase():
    timer = PhaseTimer(sync=lambda: time.sleep(0.02))  # outstanding "device work"
    with timer.phase("forward"):
        pass
    assert timer.snapshot()["forward"] >= 0.02


def test_rename_reports_fused_phase():
    timer = PhaseTimer()
    timer.rename("backward", "backward+grad_sync")
    timer.add("backward", 2.0)
    snap = timer.snapshot()
    assert snap["backward+grad_sync"] == 2.0
    assert "backward" not in snap and snap["grad_sync"] == 0.0
    assert len(snap) == len(PHASES)


def test_negative_duration_rejected_and_extra_phase_allowed():
    timer = PhaseTimer()
    with pytest.raises(ValueError, match="negative"):
        timer.add("data", -1.0)
    timer.add("eval", 3.0)
    assert timer.snapshot()["eval"] == 3.0
