"""Measured training speed and memory of ``python -m launcher.train`` on a GPU, next to the plan.

Runs each named configuration for ``--steps`` steps (no eval, no checkpoint), then reads the run's
``metrics.jsonl`` and ``plan.json`` and prints, per run: median step time after ``--warmup``
steps, tokens/s, model TFLOP/s per GPU, MFU (against the plan's peak), the step time the plan
predicted at its assumed MFU (measured / predicted is the plan's error), and peak allocated
memory against the plan's memory per GPU (measured / planned).

    python bench/gpu_train.py [--steps 30] [--warmup 8] [--out results.json] NAME=OVERRIDES ...
    python bench/gpu_train.py --preset speed [NAME=OVERRIDES ...]

``NAME=OVERRIDES`` is a run name and a comma-free, space-separated override list, e.g.
``ds="engine=deepspeed model=llama3_1b cluster=local_gpu"``. ``--preset speed`` adds issue 15's
runs (Llama 3.2 1B and eight Llama 3 8B-width layers, 8 x 4096 tokens a step, in bf16 and FP8,
the 1B with and without the fused loss, and engine=deepspeed); runs named ``X_bf16`` and
``X_fp8`` are printed as pairs with the measured and the planned FP8 / bf16 step ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXED = ["trainer.eval_interval=0", "trainer.save_interval=0", "logger=none",
         "trainer.log_interval=1", "optimizer.warmup_steps=5"]


_H100 = "cluster=local_gpu engine=megatron parallelism.zero_stage=1 model.seq_length=4096 " \
        "trainer.global_batch_size=8 "
_1B = _H100 + "model=llama3_1b trainer.micro_batch_size=2"
_8B_WIDTH = _H100 + "model=llama3_8b model.num_layers=8 trainer.micro_batch_size=1"
PRESETS = {"speed": {
    "1b_bf16": _1B,
    "1b_fp8": _1B + " trainer.precision=fp8",
    "1b_unfused_loss": _1B + " trainer.cross_entropy_fusion=off",
    "1b_deepspeed": _1B.replace("engine=megatron", "engine=deepspeed"),
    "8bw_bf16": _8B_WIDTH,
    "8bw_fp8": _8B_WIDTH + " trainer.precision=fp8",
}}
"""Named run sets (``--preset``)."""


def run(name: str, overrides: list, root: Path, steps: int) -> Path:
    """One ``launcher.train`` run; its run directory (its log is ``<root>/<name>.log``)."""
    args = [sys.executable, "-m", "launcher.train", *FIXED, *overrides,
            f"trainer.train_steps={steps}", f"run.output_root={root}", f"run.name={name}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    with open(root / f"{name}.log", "w") as log:
        proc = subprocess.run(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (root / f"{name}.log").read_text()[-3000:]
        raise RuntimeError(f"{name} exited {proc.returncode}:\n{tail}")
    return root / name


def summarise(run_dir: Path, warmup: int) -> dict:
    """Steady-state numbers of one run next to its plan."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r and r.get("step", 0) > warmup]
    plan = json.loads((run_dir / "plan.json").read_text())
    step = statistics.median(r["step_time"] for r in rows)
    planned_gb = plan["memory_per_gpu"]["total"] / 1e9
    measured_gb = max(r["memory_gb"] for r in rows)
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {
        "steps": len(rows), "step_time_s": step,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in rows),
        "mfu": statistics.median(r["mfu"] for r in rows),
        "mfu_causal": statistics.median(r.get("mfu_causal", 0.0) for r in rows),
        "plan_step_time_s": plan["step_time_s"], "plan_mfu": plan["assumed_mfu"],
        "step_vs_plan": step / plan["step_time_s"],
        "memory_gb": measured_gb, "plan_memory_gb": planned_gb,
        "memory_vs_plan": measured_gb / planned_gb,
        "flash_attention_planned": plan["flash_attention"],
        "phases_ms": {p[5:]: 1e3 * statistics.median(r.get(p, 0.0) for r in rows) for p in phases},
        "last_loss": rows[-1]["loss"],
    }


def table(results: dict) -> str:
    head = (f"{'run':14}{'step s':>8}{'plan s':>8}{'tok/s':>9}{'TFLOP/s':>9}{'MFU':>7}"
            f"{'causal':>7}"
            f"{'mem GB':>8}{'plan GB':>9}{'loss':>7}")
    lines = [head]
    for name, r in results.items():
        lines.append(f"{name:14}{r['step_time_s']:8.3f}{r['plan_step_time_s']:8.3f}"
                     f"{r['tokens_per_s']:9.0f}{r['tflops_per_gpu']:9.1f}{r['mfu']:7.1%}"
                     f"{r['mfu_causal']:7.1%}"
                     f"{r['memory_gb']:8.1f}{r['plan_memory_gb']:9.1f}{r['last_loss']:7.2f}")
        lines.append("    phases ms: " + ", ".join(f"{k} {v:.1f}"
                                                   for k, v in r["phases_ms"].items()))
    return "\n".join(lines)


def fp8_ratios(results: dict) -> str:
    """``X_fp8`` over ``X_bf16``: measured step ratio next to the plan's."""
    lines = []
    for name, r in results.items():
        base = results.get(name[:-len("_fp8")] + "_bf16") if name.endswith("_fp8") else None
        if base:
            lines.append(f"{name[:-4]:14} fp8/bf16 step: measured "
                         f"{r['step_time_s'] / base['step_time_s']:.3f}, plan "
                         f"{r['plan_step_time_s'] / base['plan_step_time_s']:.3f}; last loss "
                         f"{r['last_loss']:.3f} vs {base['last_loss']:.3f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--keep", type=Path, help="keep run directories and logs here")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="add a named set of runs")
    ap.add_argument("runs", nargs="*", help="NAME='override override ...'")
    args = ap.parse_args()
    if args.preset:
        args.runs += [f"{k}={v}" for k, v in PRESETS[args.preset].items()]
    if not args.runs:
        ap.error("name at least one run or a --preset")
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu_train_") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for spec in args.runs:
            name, _, overrides = spec.partition("=")
            try:
                run_dir = run(name, overrides.split(), root, args.steps)
                results[name] = summarise(run_dir, args.warmup)
                # the final checkpoint of a 1B model is ~15 GB: keep the disk for the next run
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            except (RuntimeError, OSError, ValueError, KeyError) as exc:
                print(f"[{name}] failed: {exc}", file=sys.stderr)
            if args.out:
                args.out.write_text(json.dumps(results, indent=2))
    print(table(results))
    print(fp8_ratios(results))
    return 0 if len(results) == len(args.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
