"""The goodput account of a run directory, on a written timeline with known answers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.runtime.goodput import account


def _write(run_dir, events, lines):
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def _line(step, time, step_time=1.0, data=0.1, checkpoint=0.0):
    return {"step": step, "time": time, "loss": 1.0, "step_time": step_time,
            "time/data": data, "time/checkpoint": checkpoint}


@pytest.fixture
def run_dir(tmp_path):
    """Attempt 0: starts at 0, 10 s of start-up, steps 1-6 (1 s each, a 0.5 s save in step 5),
    killed at 17 (1 s after its last step). Restart: attempt 1 starts at 19, resumes from step
    5, 5 s of start-up, steps 6-8, finishes at 28 (0 s of shutdown after step 8 at 27 + 1)."""
    events = [
        {"time": 0.0, "kind": "attempt_start", "attempt": 0, "message": "attempt 0"},
        {"time": 17.0, "kind": "attempt_end", "message": "attempt 0: rank 1 died (SIGKILL)"},
        {"time": 19.0, "kind": "attempt_start", "attempt": 1, "message": "attempt 1"},
        {"time": 20.0, "kind": "resume", "message": "resumed from x/step_000005 at step 5"},
        {"time": 28.0, "kind": "attempt_end", "message": "attempt 1: finished"},
    ]
    lines = [_line(s, 10.0 + s, checkpoint=0.5 if s == 5 else 0.0) for s in range(1, 7)]
    lines += [_line(s, 19.0 + 5.0 + (s - 5), data=0.2) for s in (6, 7, 8)]
    _write(tmp_path / "r", events, lines)
    return tmp_path / "r"


def test_each_second_is_counted_once(run_dir):
    acc = account(run_dir)
    lost = acc["lost_s"]
    assert acc["wall_s"] == pytest.approx(28.0)  # 17 + the 2 s gap + 9
    assert lost["startup"] == pytest.approx(10.0)
    assert lost["restart"] == pytest.approx(2.0 + 5.0)  # the gap, then start-up to step 6
    assert lost["checkpoint"] == pytest.approx(0.5)
    assert lost["data_wait"] == pytest.approx(6 * 0.1 + 3 * 0.2)
    assert lost["recomputed"] == pytest.approx(0.9)  # step 6 of attempt 0, thrown away
    assert lost["failure"] == pytest.approx(1.0)  # after attempt 0's last step, until it died
    assert lost["shutdown"] == pytest.approx(1.0)
    assert acc["productive_s"] == pytest.approx(5 * 0.9 - 0.5 + 3 * 0.8)
    assert acc["productive_s"] + sum(lost.values()) == pytest.approx(acc["wall_s"])
    assert [a["cause"] for a in acc["attempts"]] == ["rank 1 died (SIGKILL)", "finished"]
    assert [a["resumed_at"] for a in acc["attempts"]] == [0, 5]


def test_report_command_prints_json_and_text(run_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "launcher.report", str(run_dir), "--format",
                          "json"], capture_output=True, text=True, check=True).stdout
    acc = json.loads(out)
    assert set(acc) == {"wall_s", "productive_s", "goodput", "lost_s", "attempts"}
    text = subprocess.run([sys.executable, "-m", "launcher.report", str(run_dir)],
                          capture_output=True, text=True, check=True).stdout
    assert text.startswith(f"goodput {acc['goodput']:.1%} of 28.0 s wall over 2 attempts")
    bad = subprocess.run([sys.executable, "-m", "launcher.report", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
