"""The plan against the run: predicted and measured, side by side, for every run.

:func:`plan_check` reads a run directory (plan.json, metrics.jsonl, the goodput account) and
compares what the plan promised with what the run did:

* step time: the median of the steps after each attempt's first (its warm-up), less their
  checkpoint and evaluation phases (the plan's step time has neither);
* tokens per second: the global batch's tokens over that median;
* peak memory per GPU: the highest ``memory_gb`` any step logged (on a CPU run it is the
  process's resident set, libraries included, and is shown but not judged);
* goodput: the account's against the plan's expected goodput.

The launching process records the comparison of the steps it launched as a ``plan_check`` event
when a run ends normally or stops (a failure's console keeps to its cause), and its last console
line says how far off the plan was when any judged figure is more than :data:`OFF_BY` away; the
run's report shows the table.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launcher.core.jsonl import read_jsonl

OFF_BY = 0.15
"""Relative difference beyond which the run's last line says the plan was off."""
FIGURES = ("step_time_s", "tokens_per_s", "memory_gb", "goodput")


@dataclass(frozen=True)
class Comparison:
    """One figure, planned and measured."""

    name: str
    planned: float
    measured: float
    judged: bool = True
    """False when the two do not measure the same thing (CPU memory)."""

    @property
    def off(self) -> float:
        """measured / planned - 1 (0 when nothing was planned)."""
        return self.measured / self.planned - 1.0 if self.planned else 0.0


def measured_step_s(rows: list) -> Optional[float]:
    """The median step time, each attempt's first step and save/eval phases left out."""
    steps = [r for r in rows if "step_time" in r and "loss" in r]
    kept, previous = [], None
    for r in steps:
        first_of_attempt = previous is None or r["step"] <= previous
        previous = r["step"]
        if not first_of_attempt:
            kept.append(r["step_time"] - r.get("time/checkpoint", 0.0) - r.get("time/eval", 0.0))
    return statistics.median(kept) if kept else None


def plan_check(run_dir: Path, since: float = 0.0) -> list[Comparison]:
    """Every figure the plan and the run both have (module docstring), from the steps logged
    since ``since`` (epoch seconds: this launch's); [] before two steps."""
    from launcher.runtime.goodput import account

    run_dir = Path(run_dir)
    try:
        plan = json.loads((run_dir / "plan.json").read_text())
    except (OSError, ValueError):
        plan = None
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("time", 0.0) >= since]
    step = measured_step_s(rows)
    if not plan or step is None or not plan.get("step_time_s"):
        return []
    out = [Comparison("step_time_s", plan["step_time_s"], step),
           Comparison("tokens_per_s", plan["tokens_per_s"], plan["global_batch_tokens"] / step)]
    memory = max((r["memory_gb"] for r in rows if "memory_gb" in r), default=None)
    planned_memory = (plan.get("memory_per_gpu") or {}).get("total")
    if memory is not None and planned_memory:
        out.append(Comparison("memory_gb", planned_memory / 1e9, memory,
                              judged=plan.get("gpu") != "cpu"))
    expected = (plan.get("goodput") or {}).get("expected")
    if expected:
        out.append(Comparison("goodput", expected, account(run_dir)["goodput"]))
    return out


def summary(comparisons: list[Comparison]) -> str:
    """``step time 0.412 s measured vs 0.385 s planned (+7%); ...``"""
    units = {"step_time_s": ("step time", "{:.3f} s"), "tokens_per_s": ("tokens/s", "{:,.0f}"),
             "memory_gb": ("peak memory", "{:.2f} GB"), "goodput": ("goodput", "{:.1%}")}
    parts = []
    for c in comparisons:
        label, fmt = units[c.name]
        note = "" if c.judged else ", CPU resident set: not comparable"
        parts.append(f"{label} {fmt.format(c.measured)} measured vs {fmt.format(c.planned)} "
                     f"planned ({c.off:+.0%}{note})")
    return "; ".join(parts)


def off_figures(comparisons: list[Comparison]) -> list[Comparison]:
    """The judged figures more than :data:`OFF_BY` away from the plan."""
    return [c for c in comparisons if c.judged and abs(c.off) > OFF_BY]
