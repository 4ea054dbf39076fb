"""The machine probe on a GPU, and the plan it calibrates against the runs it plans.

One of bench/device/verify.sh's steps (``probe``), or by hand on a device machine after
``source bench/device/setup.sh``::

    python3 bench/device/probe_check.py [--steps 16] [--warmup 6] [overrides replacing the base]

For Llama 3.2 1B on one GPU without Transformer Engine (Megatron-Core, distributed optimizer,
bf16, 2,048-token sequences, 8 a step, unfused attention as where TE is absent), at micro-batch 2
and 1: the plan from the catalogue; ``python -m launcher.probe`` once, at micro-batch 1 (it times
the passes at micro-batches 1 and 2, so the one probe serves both), into a fresh profile folder;
the plan again, now calibrated; then ``launcher.train`` runs each layout (bench/gpu_train.py)
and the table gives measured against both plans. Exit status 1 when the probe or a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import gpu_train  # noqa: E402  (bench/gpu_train.py: one launcher.train run and its summary)

BASE = ("cluster=local_gpu engine=megatron model=llama3_1b parallelism.zero_stage=1 "
        "model.seq_length=2048 trainer.global_batch_size=8 trainer.precision=bf16 "
        "trainer.attention_backend=unfused").split()
LAYOUTS = {"mb2": ["trainer.micro_batch_size=2"], "mb1": ["trainer.micro_batch_size=1"]}
"""Micro-batch 4 does not fit in 80 GB with unfused attention."""


def python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, text=True,
                          capture_output=True)


def planned(overrides: list) -> dict:
    proc = python("-m", "launcher.plan", "plan.format=json", *overrides)
    if proc.returncode != 0:
        raise RuntimeError(f"launcher.plan exited {proc.returncode}: {proc.stderr[-2000:]}")
    plan = json.loads(proc.stdout)
    return {"step_s": plan["step_time_s"], "source": plan.get("sources", {}).get("calibration")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("overrides", nargs="*", help="replace the base overrides (e.g. a CPU rehearsal)")
    args = ap.parse_args()
    base = args.overrides or BASE
    os.environ["TRAINWRIGHT_PROFILE_DIR"] = tempfile.mkdtemp(prefix="tw-profiles-")
    rows = {name: {"catalogue": planned(base + extra)} for name, extra in LAYOUTS.items()}
    started = time.perf_counter()
    probe = python("-m", "launcher.probe", *base, *LAYOUTS["mb1"])
    print(probe.stdout[-3000:] + probe.stderr[-3000:])
    if probe.returncode != 0:
        print(f"probe FAILED (exit {probe.returncode})")
        return 1
    print(f"probe: {time.perf_counter() - started:.1f} s wall, start-up included")
    failed = False
    with tempfile.TemporaryDirectory(prefix="probe_check_") as root:
        for name, extra in LAYOUTS.items():
            rows[name]["calibrated"] = planned(base + extra)
            try:
                run_dir = gpu_train.run(name, base + extra, Path(root), args.steps)
                rows[name]["run"] = gpu_train.summarise(run_dir, args.warmup)
            except RuntimeError as exc:
                print(f"{name}: run FAILED: {exc}")
                failed = True
    print(table(rows))
    print(json.dumps(rows, indent=1, default=str))
    return 1 if failed else 0


def table(rows: dict) -> str:
    lines = [f"{'layout':8}{'measured s':>12}{'catalogue s':>13}{'error':>8}"
             f"{'calibrated s':>14}{'error':>8}  calibration"]
    for name, r in rows.items():
        got = r.get("run", {}).get("step_time_s")
        cat, cal = r["catalogue"]["step_s"], r.get("calibrated", {}).get("step_s")
        err = (lambda p: f"{p / got - 1:+8.1%}" if got and p else f"{'-':>8}")
        lines.append(f"{name:8}{got or float('nan'):12.3f}{cat:13.3f}{err(cat)}"
                     f"{cal or float('nan'):14.3f}{err(cal)}  "
                     f"{r.get('calibrated', {}).get('source')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
