"""The plan against real CPU runs: predicted and measured step time over a matrix of configs.

    .venv/bin/python bench/plan_accuracy.py [--only NAME ...] [--steps 6] [--json out.json]
    .venv/bin/python bench/plan_accuracy.py --out-of-sample --steps 24 --warm 12 [--json ...]
    .venv/bin/python bench/plan_accuracy.py --uncalibrated [--json ...]

For each config of :data:`MATRIX` (2 CPU ranks: three model sizes, DP2 / TP2 / PP2 with and
without VPP, ZeRO 0-3, both engines, fp32 and bf16 where this CPU computes it fast, other
micro-batch and accumulation splits), as a user would:

1. ``python -m launcher.probe <config>`` writes this machine's profile (a profile directory of
   the bench's own: nothing of the user's is read or changed);
2. ``python -m launcher.plan <config> plan.format=json`` predicts the step time from it;
3. ``python -m launcher.train <config>`` runs ``--steps`` steps; the measured step time is the
   median of the steps after the first ``--warm`` (a CPU run reaches its pace after a few).

Then, for the layouts of the first model: the predicted order with the base config's probe
alone (what the search sees: one probe for every layout) against the measured order: the
predicted fastest, its measured distance to the measured fastest, Kendall's tau. Prints a table
and the median and largest |error|; figures go to docs/plan.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY = ["model=tiny"]
SMALL = ["model=tiny", "model.num_layers=6", "model.hidden_size=512",
         "model.ffn_hidden_size=1408", "model.num_attention_heads=8", "model.num_query_groups=4"]
GPT2 = ["model=gpt2_124m", "model.seq_length=256", "model.hidden_dropout=0",
        "model.attention_dropout=0"]
MEGATRON, DEEPSPEED = ["engine=megatron"], ["engine=deepspeed"]

MATRIX = {
    # layouts of the tiny model (the ordering check uses these, all fp32 and bf16 alike)
    "tiny dp2 megatron zero1": TINY + MEGATRON,
    "tiny dp2 megatron zero0": TINY + MEGATRON + ["parallelism.zero_stage=0"],
    "tiny tp2 megatron": TINY + MEGATRON + ["parallelism=tp2",
                                            "parallelism.sequence_parallel=false"],
    "tiny tp2 sp megatron": TINY + MEGATRON + ["parallelism=tp2",
                                               "parallelism.sequence_parallel=true"],
    "tiny pp2 megatron": TINY + MEGATRON + ["parallelism=pp2", "trainer.global_batch_size=16"],
    "tiny pp2 vpp2 megatron": TINY + MEGATRON + ["parallelism=pp2",
                                                 "parallelism.virtual_pipeline_parallel_size=2",
                                                 "trainer.global_batch_size=16"],
    "tiny dp2 deepspeed zero1": TINY + DEEPSPEED,
    "tiny dp2 deepspeed zero2": TINY + DEEPSPEED + ["parallelism.zero_stage=2"],
    "tiny dp2 deepspeed zero3": TINY + DEEPSPEED + ["parallelism.zero_stage=3"],
    "tiny mb2 x accum2": TINY + MEGATRON + ["trainer.micro_batch_size=2",
                                            "trainer.global_batch_size=8"],
    "tiny mb1 x accum4 deepspeed": TINY + DEEPSPEED + ["trainer.micro_batch_size=1",
                                                       "trainer.global_batch_size=8"],
    "tiny fp32 megatron": TINY + MEGATRON + ["trainer.precision=fp32"],
    "tiny fp32 deepspeed": TINY + DEEPSPEED + ["trainer.precision=fp32"],
    "small dp2 megatron": SMALL + MEGATRON + ["trainer.micro_batch_size=2"],
    "small tp2 megatron": SMALL + MEGATRON + ["parallelism=tp2", "trainer.micro_batch_size=2"],
    "gpt2 dp2 megatron": GPT2 + MEGATRON + ["trainer.micro_batch_size=1"],
    "gpt2 dp2 deepspeed": GPT2 + DEEPSPEED + ["trainer.micro_batch_size=1"],
}
UNSEEN = {
    # issue 48's five configs the bench had not run, fp32 (--uncalibrated)
    "unseen tiny dp2 deepspeed": TINY + DEEPSPEED,
    "unseen tiny tp2 megatron": TINY + MEGATRON + ["parallelism=tp2"],
    "unseen tiny pp2 x accum4": TINY + MEGATRON + ["parallelism=pp2", "trainer.micro_batch_size=1",
                                                   "trainer.global_batch_size=4"],
    "unseen gpt2 zero2 seq128": ["model=gpt2_124m", "model.seq_length=128",
                                 "model.hidden_dropout=0", "model.attention_dropout=0"]
    + DEEPSPEED + ["parallelism.zero_stage=2", "trainer.micro_batch_size=1"],
    "unseen 6x512 x accum2": SMALL + MEGATRON + ["trainer.micro_batch_size=1",
                                                 "trainer.global_batch_size=4"],
}
ORDERED = [name for name in MATRIX if name.startswith("tiny ") and "fp32" not in name]
"""The layouts whose order the search must get right (one model, one precision)."""
COMMON = ["trainer.eval_interval=0", "trainer.save_interval=0", "run.report=false",
          "data=mock", "trainer.log_interval=1"]


def _run(args: list, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr[-3000:]}")
    return proc


def planned(config: list, env: dict) -> float:
    out = _run(["-m", "launcher.plan", *config, "plan.format=json"], env).stdout
    plan = json.loads(out)
    if "measured" not in plan["sources"]["step time"]:
        raise SystemExit(f"the plan of {config} is not calibrated: {plan['sources']}")
    return plan["step_time_s"]


def measured(config: list, env: dict, root: Path, name: str, steps: int, warm: int) -> float:
    """The run's median step time once warm: the steps after the first ``warm`` (a CPU run
    takes several steps to reach its pace: oneDNN primitives, the allocator, the loader)."""
    from launcher.core.jsonl import read_jsonl

    run = name.replace(" ", "_")
    _run(["-m", "launcher.train", *config, f"trainer.train_steps={steps}",
          f"run.output_root={root}", f"run.name={run}"], env)
    rows = [r for r in read_jsonl(root / run / "metrics.jsonl") if "step_time" in r]
    return statistics.median(r["step_time"] for r in rows if r["step"] > warm)


CALIBRATION = "tiny fp32 megatron"
"""The one config whose run sets the CPU matmul efficiency (launcher/plan/cpu_rates.py) in
``--uncalibrated``; the :data:`UNSEEN` configs are then planned out of sample."""
OLD_CATALOGUE = ["cluster.peak_tflops=0.2"]
"""The catalogue's placeholder cpu peak (0.2 TFLOP/s, 20 GB/s), which the CPU check's rates
replaced; with today's cpu links and engine factors, so not exactly the plan before them
(bench/results/plan_uncalibrated_cpu_check.json keeps a run from before)."""


def uncalibrated(args, base: dict, root: Path) -> dict:
    """Plans without a probe against real runs of the :data:`UNSEEN` configs in fp32 (those
    ``--only`` names, and :data:`CALIBRATION` always): with the CPU check's rates at the shipped
    efficiency, at the efficiency that makes
    :data:`CALIBRATION`'s plan match its run, and with the old catalogue placeholder."""
    env = {**base, "TRAINWRIGHT_PROFILE_DIR": str(root / "profiles" / "uncalibrated")}
    configs = {CALIBRATION: MATRIX[CALIBRATION],  # always: it fits the efficiency
               **{n: c for n, c in UNSEEN.items()
                  if not args.only or any(o in n for o in args.only)}}
    rows = {}
    for name, config in configs.items():
        config = config + COMMON + ["trainer.precision=fp32"]
        plan = json.loads(_run(["-m", "launcher.plan", *config, "plan.format=json"],
                               env).stdout)
        old = json.loads(_run(["-m", "launcher.plan", *config, *OLD_CATALOGUE,
                               "plan.format=json"], env).stdout)["step_time_s"]
        got = measured(config, env, root, name, args.steps, args.warm)
        rows[name] = {"check": plan["step_time_s"], "catalogue": old, "measured": got,
                      "config": config}
        print(f"{name:28s} measured {got:.3f} s  planned {plan['step_time_s']:.3f} s "
              f"({plan['step_time_s'] / got:.2f}x; old catalogue {old / got:.2f}x)", flush=True)
    os.environ["TRAINWRIGHT_PROFILE_DIR"] = env["TRAINWRIGHT_PROFILE_DIR"]
    efficiency = fitted_efficiency(rows[CALIBRATION])
    for name, row in rows.items():
        row["fitted"] = planned_at(row.pop("config"), efficiency)
    print(f"CPU_GEMM_EFFICIENCY fitted on {CALIBRATION!r}: {efficiency:.3f}")
    for key in ("catalogue", "check", "fitted"):
        ratios = [r[key] / r["measured"] for n, r in rows.items() if n in UNSEEN]
        errors = [abs(x - 1) for x in ratios]
        print(f"  {key:9s}: median |error| {statistics.median(errors):.1%}, largest "
              f"{max(errors):.1%} over the {len(errors)} unseen configs "
              f"({', '.join(f'{x:.2f}x' for x in ratios)})")
    return {"rows": rows, "fitted_efficiency": efficiency}


def planned_at(config: list, efficiency: float) -> float:
    """The uncalibrated plan's step time of ``config`` at CPU_GEMM_EFFICIENCY=``efficiency``
    (in this process, the profile directory of the environment)."""
    from launcher.compose import compose_config, to_object
    from launcher.plan import compute_plan
    from launcher.plan import cpu_rates

    shipped = cpu_rates.CPU_GEMM_EFFICIENCY
    cpu_rates.CPU_GEMM_EFFICIENCY = efficiency
    try:
        return compute_plan(to_object(compose_config(config))).compute.step_time_s
    finally:
        cpu_rates.CPU_GEMM_EFFICIENCY = shipped


def fitted_efficiency(row: dict) -> float:
    """The efficiency at which ``row``'s config is planned at its measured step time
    (bisection: the planned time falls as the efficiency rises)."""
    low, high = 0.01, 2.0
    for _ in range(40):
        mid = (low * high) ** 0.5
        if planned_at(row["config"], mid) > row["measured"]:
            low = mid
        else:
            high = mid
    return (low * high) ** 0.5


def model_groups() -> dict:
    """{the first config of a model and precision: every config of it} over :data:`MATRIX`:
    what one probe of a model can plan (a probe's passes are per model and precision)."""
    groups: dict = {}
    for name in MATRIX:
        kind = (name.split()[0], "fp32" in name)
        groups.setdefault(kind, []).append(name)
    return {names[0]: names for names in groups.values()}


def out_of_sample(args, base: dict, root: Path) -> dict:
    """One probe per model and precision (its first config), every config of it planned from
    that profile alone and trained; the probed config trained twice (the run-to-run spread)."""
    rows = {}
    groups = {p: names for p, names in model_groups().items()
              if not args.only or any(o in p for o in args.only)}
    for probed, names in groups.items():
        env = {**base, "TRAINWRIGHT_PROFILE_DIR": str(root / "profiles" / probed)}
        _run(["-m", "launcher.probe", *MATRIX[probed], *COMMON,
              f"run.output_root={root / 'probe'}", f"run.name={probed.replace(' ', '_')}"], env)
        for name in names + [probed]:
            config = MATRIX[name] + COMMON
            key = name if name not in rows else f"{name} again"
            got = measured(config, env, root, key, args.steps, args.warm)
            rows[key] = {"probe": probed, "planned": planned(config, env), "measured": got}
            r = rows[key]
            r["error"] = r["planned"] / got - 1
            print(f"{key:40s} planned {r['planned']:.3f} s  measured {got:.3f} s  "
                  f"error {r['error']:+.1%}  (probe: {probed})", flush=True)
    others = [abs(r["error"]) for k, r in rows.items() if k != r["probe"] and "again" not in k]
    spread = [abs(rows[f"{p} again"]["measured"] / rows[p]["measured"] - 1)
              for p in groups]
    print(f"planned from another layout's probe: median |error| {statistics.median(others):.1%}"
          f", largest {max(others):.1%} over {len(others)} configs; the probed config run "
          f"twice differs by {', '.join(f'{x:.1%}' for x in spread)}")
    return rows


def kendall_tau(a: list, b: list) -> float:
    pairs = list(combinations(range(len(a)), 2))
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) \
        - sum((a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return score / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warm", type=int, default=6, help="steps left out as warm-up")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--uncalibrated", action="store_true",
                        help="plan the unseen configs without a probe (the CPU check's "
                             "rates, fitted on one config, and the old catalogue)")
    parser.add_argument("--out-of-sample", action="store_true",
                        help="one probe per model; every other config planned from it")
    args = parser.parse_args()
    for wanted, mode in ((args.out_of_sample, out_of_sample), (args.uncalibrated, uncalibrated)):
        if wanted:
            with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
                rows = mode(args, {**os.environ, "OMP_NUM_THREADS": "1",
                                   "WANDB_MODE": "disabled"}, Path(tmp))
            if args.json:
                args.json.write_text(json.dumps({mode.__name__: rows}, indent=1))
            return
    names = [n for n in MATRIX if not args.only or any(o in n for o in args.only)]
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        root = Path(tmp)
        base = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        rows = {}
        for name in names:
            config = MATRIX[name] + COMMON
            env = {**base, "TRAINWRIGHT_PROFILE_DIR": str(root / "profiles" / name)}
            _run(["-m", "launcher.probe", *config, f"run.output_root={root / 'probe'}",
                  f"run.name={name.replace(' ', '_')}"], env)
            rows[name] = {"planned": planned(config, env),
                          "measured": measured(config, env, root, name, args.steps,
                                               args.warm)}
            r = rows[name]
            r["error"] = r["planned"] / r["measured"] - 1
            print(f"{name:32s} planned {r['planned']:.3f} s  measured {r['measured']:.3f} s  "
                  f"error {r['error']:+.1%}", flush=True)
        errors = [abs(r["error"]) for r in rows.values()]
        print(f"median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%} "
              f"over {len(errors)} configs")
        ordering = order_check(rows, root, base)
        if args.json:
            args.json.write_text(json.dumps({"rows": rows, "ordering": ordering}, indent=1))


def order_check(rows: dict, root: Path, base: dict) -> dict:
    """The layouts of the tiny model predicted from the first one's probe alone."""
    names = [n for n in ORDERED if n in rows]
    if len(names) < 3:
        return {}
    env = {**base, "TRAINWRIGHT_PROFILE_DIR": str(root / "profiles" / names[0])}
    predicted = [planned(MATRIX[n] + COMMON, env) for n in names]
    actual = [rows[n]["measured"] for n in names]
    for n, p, m in zip(names, predicted, actual):
        print(f"  {n:32s} predicted {p:.3f} s  measured {m:.3f} s  {p / m - 1:+.1%}")
    best = min(range(len(names)), key=predicted.__getitem__)
    gap = actual[best] / min(actual) - 1
    tau = kendall_tau(predicted, actual)
    print(f"one probe ({names[0]}) for {len(names)} layouts: predicted fastest {names[best]!r}, "
          f"{gap:+.1%} from the measured fastest; Kendall's tau {tau:.2f}")
    return {"layouts": names, "predicted": predicted, "measured": actual, "gap": gap,
            "tau": tau}


if __name__ == "__main__":
    main()
