"""How long `python -m launcher.plan` takes for the 16,384-GPU experiment, and where it goes.

Side by side in one run: (1) in-process timings of compose, compute_plan and rendering, each the
median of N repetitions; (2) the whole command as a process, against a baseline process that only
starts Python and imports Hydra (the floor any Hydra-based CLI pays). The ratio of the two shows
the plan's own cost above that floor.

    .venv/bin/python bench/plan_speed.py [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import time

from rich.console import Console

from launcher.compose import compose_config, to_object
from launcher.plan import compute_plan
from launcher.plan.report import render_plan

OVERRIDES = ["experiment=llama3_70b_16k_h100"]


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(repeats: int) -> dict:
    cfg = to_object(compose_config(OVERRIDES))
    plan = compute_plan(cfg)
    sink = Console(file=io.StringIO(), width=100)
    return {
        "compose_s": _median_s(lambda: to_object(compose_config(OVERRIDES)), repeats),
        "compute_plan_s": _median_s(lambda: compute_plan(cfg), repeats),
        "render_table_s": _median_s(lambda: render_plan(plan, sink), repeats),
    }


def _process_s(argv: list[str], repeats: int) -> float:
    def run():
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return _median_s(run, repeats)


def whole_process(repeats: int) -> dict:
    baseline = _process_s([sys.executable, "-c", "import hydra, omegaconf, rich"], repeats)
    plan = _process_s([sys.executable, "-m", "launcher.plan", *OVERRIDES], repeats)
    return {"baseline_process_s": baseline, "plan_process_s": plan,
            "plan_over_baseline_s": plan - baseline, "ratio": plan / baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {**in_process(args.repeats), **whole_process(max(3, args.repeats // 4))}
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        unit = "" if key == "ratio" else " s"
        print(f"{key:>22}: {value:.4f}{unit}")


if __name__ == "__main__":
    main()
