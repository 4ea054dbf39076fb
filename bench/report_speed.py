"""How long a long run's report takes, and how big it is.

    .venv/bin/python bench/report_speed.py [--steps 1000000] [--workdir /tmp/tw_report]

Writes a synthetic run directory of ``--steps`` step lines as launcher.train writes them (every
metric key: loss, lr, gradient norm, throughput, memory, the seven phases; an evaluation every
1,000 steps, a checkpoint event every 5,000, a loss spike, one in-job restart), then times
``python -m launcher.report RUN --format html`` and ``--format text`` as whole processes and
prints the seconds, the page's size and the points its loss chart keeps (the issue's target:
a 1,000,000-step run renders into a file under 10 MB).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("data", "forward", "loss", "backward", "grad_sync", "optimizer", "checkpoint")
SHARES = (0.005, 0.09, 0.005, 0.17, 0.02, 0.01, 0.0)
"""Seconds of each phase in a 0.3 s step."""


def write_run(run_dir: Path, steps: int) -> None:
    """A run directory of ``steps`` steps with one restart at 60% (steps recomputed)."""
    run_dir.mkdir(parents=True)
    rng, t0, restart_at = random.Random(0), 1.7e9, int(steps * 0.6)
    events = [{"time": t0, "kind": "attempt_start", "message": "attempt 0: 8 rank(s) started",
               "attempt": 0}]
    with (run_dir / "metrics.jsonl").open("w") as out:
        clock = t0 + 30.0
        resumed = restart_at - 200  # the last checkpoint before the failure
        for i, step in enumerate(list(range(1, restart_at + 1))
                                 + list(range(resumed + 1, steps + 1))):
            if i == restart_at:
                events += [{"time": clock, "kind": "attempt_end", "attempt": 0, "restart": True,
                            "message": "attempt 0: rank 3 died (SIGKILL)"},
                           {"time": clock + 20, "kind": "attempt_start", "attempt": 1,
                            "message": "attempt 1: 8 rank(s) started"},
                           {"time": clock + 25, "kind": "resume", "step": resumed,
                            "message": f"resumed from step_{resumed} at step {resumed}"}]
                clock += 30
            clock += 0.3
            loss = 2.0 + 9.0 / math.sqrt(1 + step / 500) + rng.random() * 0.05
            row = {"step": step, "time": round(clock, 3), "loss": loss + (4 if step == 777 else 0),
                   "lr": 3e-4 * min(1.0, step / 2000), "grad_norm": 0.5 + rng.random(),
                   "loss_scale": 1.0, "tokens_per_s": 4.0e5 + rng.random() * 1e4,
                   "mfu": 0.41 + rng.random() * 0.01, "consumed_samples": step * 512,
                   "step_time": 0.3, "memory_gb": 61.2 + rng.random() * 0.1}
            row.update({f"time/{p}": t for p, t in zip(PHASES, SHARES)})
            out.write(json.dumps(row) + "\n")
            if step % 1000 == 0:
                out.write(json.dumps({"step": step, "time": clock, "eval/loss": loss + 0.05,
                                      "eval/perplexity": math.exp(loss)}) + "\n")
            if step % 5000 == 0:
                events.append({"time": clock, "kind": "checkpoint", "step": step,
                               "message": f"checkpoint step {step} saved", "bytes": 17e9,
                               "seconds": 14.0})
    events.append({"time": clock + 5, "kind": "attempt_end", "attempt": 1, "restart": False,
                   "message": "attempt 1: finished"})
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "plan.json").write_text(json.dumps({"train_steps": steps, "step_time_s": 0.29,
                                                   "global_batch_tokens": 4_194_304}))


def timed(args: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launcher.report", *args], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return time.perf_counter() - start, proc.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--workdir", default="/tmp/tw_report")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    start = time.perf_counter()
    write_run(work / "run", args.steps)
    written = time.perf_counter() - start
    html_s, _ = timed([str(work / "run"), "--format", "html"])
    text_s, text = timed([str(work / "run"), "--format", "text"])
    page = work / "run" / "report.html"
    size = page.stat().st_size
    kept = len(re.search(r'"name":"train loss".*?"x":\[(.*?)\]', page.read_text()).group(1)
               .split(","))
    metrics_mb = (work / "run" / "metrics.jsonl").stat().st_size / 1e6
    print(f"{args.steps:,} steps (metrics.jsonl {metrics_mb:,.0f} MB, written in {written:.1f} s)")
    print(f"  --format html: {html_s:.1f} s, report.html {size / 1e6:.2f} MB, loss chart keeps "
          f"{kept:,} points")
    print(f"  --format text: {text_s:.1f} s ({text.splitlines()[0]})")
    print(json.dumps({"steps": args.steps, "html_s": html_s, "text_s": text_s,
                      "html_bytes": size, "loss_points": kept}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
