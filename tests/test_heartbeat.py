"""A rank's heartbeat: the record the watchdog reads, and the timeouts it asks for."""

from __future__ import annotations

import os

from launcher.config import ResilienceConfig
from launcher.runtime.heartbeat import STARTUP, Heartbeat, read_beat, record_path


def _beat(tmp_path, **settings):
    return Heartbeat(record_path(tmp_path, 3), ResilienceConfig(**settings))


def test_the_watchdog_reads_the_last_phase_step_and_pid(tmp_path):
    hb = _beat(tmp_path)
    assert read_beat(record_path(tmp_path, 3)) is None  # nothing written yet
    hb.phase(STARTUP)
    hb.step = 41
    hb.phase("backward")
    beat = read_beat(record_path(tmp_path, 3))
    assert (beat.step, beat.phase, beat.pid) == (41, "backward", os.getpid())
    assert beat.timeout_s == 1800.0  # a phase never seen before: first_phase_timeout_s


def test_automatic_timeout_learns_from_the_longest_phase(tmp_path, monkeypatch):
    clock = iter([100.0, 101.0, 103.0, 110.0, 111.0, 112.0])
    monkeypatch.setattr("launcher.runtime.heartbeat.time.time", lambda: next(clock))
    hb = _beat(tmp_path, auto_timeout_factor=5.0, auto_timeout_floor_s=20.0,
               first_phase_timeout_s=600.0)
    hb.phase(STARTUP)          # t=100
    hb.phase("forward")        # t=101: startup took 1 s
    hb.phase("checkpoint")     # t=103: forward took 2 s
    hb.phase("forward")        # t=110: a 7 s save
    assert hb.timeout_for("forward") == 35.0  # 5 x the longest phase (the save)
    assert hb.timeout_for("eval") == 600.0    # not seen yet
    assert hb.timeout_for(STARTUP) == 600.0   # start-up always has first_phase_timeout_s
    hb.agree([0.5, 200.0])     # another rank's step took 200 s
    assert hb.timeout_for("forward") == 600.0  # 5 x 200 s, capped at first_phase_timeout_s


def test_floor_fixed_and_off(tmp_path):
    hb = _beat(tmp_path, auto_timeout_floor_s=60.0)
    hb._longest = {"forward": 0.01}
    assert hb.timeout_for("forward") == 60.0
    fixed = _beat(tmp_path, hang_timeout_s=12.0, first_phase_timeout_s=600.0)
    assert fixed.timeout_for("forward") == 600.0  # not finished once yet: a first step's warm-up
    fixed.phase("forward")
    fixed.phase("backward")
    assert fixed.timeout_for("forward") == 12.0
    assert _beat(tmp_path, hang_timeout_s=-1.0).timeout_for("forward") < 0
