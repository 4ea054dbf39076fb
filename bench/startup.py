"""Launch to first step, and final save to exit, of a 2-rank CPU run of the tiny model.

    .venv/bin/python bench/startup.py [--runs 3] [--engines deepspeed megatron]

Each run is ``python -m launcher.train`` as a user types it (the tiny model of
``conf/model/tiny.yaml``, the defaults otherwise: 2 ranks, mock data, a final save), timed from
outside and read back from its run directory:

* start-up: the command's start -> the first step's start (the step line's time less its step
  time), and its parts from the ``startup`` event the run logs (launcher, imports, process
  group, run directory, build, checkpoint, data);
* exit: the final save's ``checkpoint ... saved`` event -> the command's exit.

Prints each run and the medians; the figures in docs/training.md come from here. With
``--spawned`` every run is made twice, turn about: as a user's (ranks forked from the fork server
that imported their libraries while the launcher planned) and with ``TRAINWRIGHT_SPAWN_RANKS=1``
(each rank spawned, importing them itself), and the ratio of the medians is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = ["trainer.train_steps=4", "trainer.eval_interval=0", "trainer.save_interval=0",
       "trainer.log_interval=1", "run.report=false"]


def _rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []


def one_run(root: Path, engine: str, n: int, repo: Path = REPO, spawned: bool = False) -> dict:
    name = f"{engine}{n}{'_spawned' if spawned else ''}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "TRAINWRIGHT_SPAWN_RANKS": "1" if spawned else "0"}
    args = [sys.executable, "-m", "launcher.train", f"engine={engine}", *RUN,
            f"run.output_root={root}", f"run.name={name}"]
    started = time.time()
    proc = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True)
    ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{engine} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run_dir = root / name
    steps = [r for r in _rows(run_dir / "metrics.jsonl") if "step_time" in r]
    events = _rows(run_dir / "events.jsonl")
    first = min(r["time"] - r["step_time"] for r in steps)
    parts = next((e for e in events if e["kind"] == "startup"), {})
    saved = max(e["time"] for e in events if e["kind"] == "checkpoint"
                and " saved" in e["message"])
    return {"startup_s": first - started, "exit_s": ended - saved,
            "parts": {k[:-2]: v for k, v in parts.items() if k.endswith("_s")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["deepspeed", "megatron"])
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="the checkout to run (another commit, for a baseline)")
    parser.add_argument("--spawned", action="store_true",
                        help="each run also with TRAINWRIGHT_SPAWN_RANKS=1 (ranks spawned, not "
                             "forked from the preloaded server), turn about")
    args = parser.parse_args()
    kinds = (False, True) if args.spawned else (False,)
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        for engine in args.engines:
            runs = {kind: [] for kind in kinds}
            for n in range(args.runs):
                for kind in kinds:
                    runs[kind].append(one_run(Path(tmp), engine, n, args.repo, kind))
            for kind in kinds:
                _print(f"{engine}{' spawned' if kind else ''}", runs[kind])
            if args.spawned:
                ratio = statistics.median(r["startup_s"] for r in runs[False]) / \
                    statistics.median(r["startup_s"] for r in runs[True])
                print(f"{engine}: forked/spawned start-up {ratio:.2f}x")


def _print(label: str, runs: list) -> None:
    for r in runs:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts"].items())
        print(f"{label}: start-up {r['startup_s']:.2f} s ({parts}); "
              f"exit {r['exit_s']:.2f} s after the final save")
    print(f"{label}: median start-up {statistics.median(r['startup_s'] for r in runs):.2f} s, "
          f"median exit {statistics.median(r['exit_s'] for r in runs):.2f} s over {len(runs)} "
          "runs")

if __name__ == "__main__":
    main()
