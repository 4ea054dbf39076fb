"""One probe for the layout search, A/B: two checkouts' probes and plans against one set of runs.

    .venv/bin/python bench/plan_order_ab.py --baseline /path/to/worktree [--probes 2] [--keep DIR]
    .venv/bin/python bench/plan_order_ab.py --replan DIR     # this checkout's plan, stored probes

Trains every layout of :data:`bench.plan_accuracy.ORDERED` once with this checkout (the measured
step times: the training path is the same in both), then, ``--probes`` times and alternating,
probes the base layout with each checkout (its own profile directory) and plans all layouts from
that probe alone. Prints per probe: Kendall's tau, the predicted fastest and its measured gap,
the median and largest |error|, and every layout's error. ``--replan DIR`` plans again, with this
checkout, from the profiles a ``--keep DIR`` run stored (a plan-side change against the same
probes). Numbers in docs/plan.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.plan_accuracy import COMMON, MATRIX, ORDERED, kendall_tau, measured  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def _out(repo: Path, args: list, profiles: Path) -> str:
    env = {**ENV, "PYTHONPATH": str(repo), "TRAINWRIGHT_PROFILE_DIR": str(profiles)}
    proc = subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed in {repo}: {' '.join(args)}\n{proc.stderr[-2000:]}")
    return proc.stdout


def report(tag: str, repo: Path, profiles: Path, actual: dict) -> None:
    predicted = [json.loads(_out(repo, ["-m", "launcher.plan", *MATRIX[n], *COMMON,
                                        "plan.format=json"], profiles))["step_time_s"]
                 for n in ORDERED]
    act = [actual[n] for n in ORDERED]
    errors = [p / m - 1 for p, m in zip(predicted, act)]
    best = min(range(len(predicted)), key=predicted.__getitem__)
    print(f"{tag}: tau {kendall_tau(predicted, act):.2f}  fastest {ORDERED[best]!r} "
          f"{act[best] / min(act) - 1:+.1%}  median |error| "
          f"{statistics.median(map(abs, errors)):.1%}  largest {max(map(abs, errors)):.1%}  "
          + " ".join(f"{e:+.0%}" for e in errors), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of the commit to compare")
    parser.add_argument("--probes", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="keep the measurements and profiles here")
    parser.add_argument("--replan", type=Path, help="a --keep directory to plan again from")
    args = parser.parse_args()
    if args.replan:
        actual = json.loads((args.replan / "measured.json").read_text())
        for profiles in sorted(args.replan.glob("profiles_*")):
            report(profiles.name, REPO, profiles, actual)
        return
    if args.baseline is None:
        parser.error("--baseline or --replan is needed")
    root = args.keep or Path(tempfile.mkdtemp(prefix="plan-order-ab-"))
    root.mkdir(parents=True, exist_ok=True)
    actual = {}
    for name in ORDERED:
        actual[name] = measured(MATRIX[name] + COMMON, {**ENV, "PYTHONPATH": str(REPO)}, root,
                                name, 16, 6)
        print(f"measured {name:32s} {actual[name]:.3f} s", flush=True)
    (root / "measured.json").write_text(json.dumps(actual))
    for trial in range(args.probes):
        for tag, repo in (("baseline", args.baseline.resolve()), ("this", REPO)):
            profiles = root / f"profiles_{tag}_{trial}"
            _out(repo, ["-m", "launcher.probe", *MATRIX[ORDERED[0]], *COMMON,
                        f"run.output_root={root / 'probe'}", f"run.name={tag}{trial}"], profiles)
            report(f"{tag} probe {trial}", repo, profiles, actual)


if __name__ == "__main__":
    main()
