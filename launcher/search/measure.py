"""``search.measure=K``: run the best K candidates for a few steps each through
``python -m launcher.train`` on this machine and re-rank them by measured step time.

Each run is a subprocess with the search's own overrides, the candidate's, a fixed number of
steps (``search.measure_steps``) and its own run directory under
``<run.output_root>/search_measure/``; the step time is the median ``step_time`` of the
run's ``metrics.jsonl`` lines after the first step (which includes warm-up).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from launcher.search.evaluate import Scored

REPO = Path(__file__).resolve().parents[2]


def measured_step_time(run_dir: Path) -> float | None:
    """Median step_time of the training lines after the first; None when there are none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = [r["step_time"] for r in rows if "loss" in r and "step_time" in r and r["step"] > 1]
    return statistics.median(times) if times else None


def run_candidate(base: list[str], s: Scored, index: int, root: Path, steps: int,
                  timeout: float = 1800.0) -> dict:
    """Train candidate ``s`` for ``steps`` steps; {overrides, measured step time, exit code}."""
    name = f"candidate_{index}"
    args = [sys.executable, "-m", "launcher.train", *base, *s.candidate.overrides(),
            f"trainer.train_steps={steps}", "trainer.train_tokens=0", "trainer.eval_interval=0",
            f"trainer.save_interval={steps}", "optimizer.warmup_steps=0",
            f"run.output_root={root}", f"run.name={name}"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    measured = measured_step_time(root / name) if proc.returncode == 0 else None
    return {"overrides": s.candidate.overrides(), "predicted_step_time_s": s.step.total,
            "measured_step_time_s": measured, "exit_code": proc.returncode,
            "run_dir": str(root / name),
            "error": None if proc.returncode == 0 else proc.stderr[-2000:]}


def measure(base: list[str], top: list[Scored], k: int, steps: int, output_root: str) -> list:
    """Run the best ``k`` of ``top``; the results, fastest measured first (failed runs last)."""
    root = Path(output_root).resolve() / "search_measure"
    root.mkdir(parents=True, exist_ok=True)
    results = [run_candidate(base, s, i, root, steps) for i, s in enumerate(top[:k], 1)]
    return sorted(results, key=lambda r: (r["measured_step_time_s"] is None,
                                          r["measured_step_time_s"] or 0.0))
