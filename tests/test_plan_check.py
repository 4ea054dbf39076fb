"""Every run records the plan against what it measured, and its last line says so when the plan
was more than 15% off."""

from __future__ import annotations

import json
import statistics

import pytest

from launcher.reports.plan_check import Comparison, measured_step_s, off_figures, summary
from tests.helpers.training import train


def test_the_measured_step_leaves_out_warm_up_saves_and_evaluations():
    rows = [{"step": 1, "loss": 1, "step_time": 9.0},  # the first attempt's warm-up
            {"step": 2, "loss": 1, "step_time": 1.0},
            {"step": 3, "loss": 1, "step_time": 3.5, "time/checkpoint": 2.4},
            {"step": 4, "loss": 1, "step_time": 1.6, "time/eval": 0.5},
            {"step": 3, "loss": 1, "step_time": 7.0},  # a restart: its first step is warm-up
            {"step": 4, "loss": 1, "step_time": 1.2},
            {"step": 4, "eval/loss": 2.0}]
    assert measured_step_s(rows) == pytest.approx(statistics.median([1.0, 1.1, 1.1, 1.2]))
    assert measured_step_s(rows[:1]) is None


def test_only_judged_figures_beyond_15_percent_are_off():
    comparisons = [Comparison("step_time_s", 1.0, 1.1), Comparison("tokens_per_s", 100, 70),
                   Comparison("memory_gb", 0.2, 0.9, judged=False)]
    assert [c.name for c in off_figures(comparisons)] == ["tokens_per_s"]
    assert summary(comparisons[:1]) == "step time 1.100 s measured vs 1.000 s planned (+10%)"


@pytest.mark.slow
def test_a_run_records_the_plan_against_the_run(tmp_path):
    proc = train(tmp_path, "check", "trainer.train_steps=6", "trainer.eval_interval=0",
                 "trainer.save_interval=0")
    run_dir = tmp_path / "check"
    plan = json.loads((run_dir / "plan.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    event = next(json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                 if '"plan_check"' in line)
    steps = [r["step_time"] - r.get("time/checkpoint", 0.0) for r in rows if "loss" in r][1:]
    assert event["step_time_s/measured"] == pytest.approx(statistics.median(steps))
    assert event["step_time_s/planned"] == pytest.approx(plan["step_time_s"])
    assert event["tokens_per_s/measured"] == pytest.approx(
        plan["global_batch_tokens"] / statistics.median(steps))
    assert event["goodput/planned"] == pytest.approx(plan["goodput"]["expected"])
    off = [name for name in ("step_time_s", "tokens_per_s", "goodput")
           if abs(event[f"{name}/measured"] / event[f"{name}/planned"] - 1) > 0.15]
    last = proc.stderr.strip().splitlines()[-1]
    if off:
        assert last.startswith("[plan] off by more than 15%: ")
    else:
        assert "[plan]" not in proc.stderr
