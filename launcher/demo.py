"""``make demo``: the embedded default, end to end, in a few minutes on two CPU cores.

1. corpus: the top-level modules of this interpreter's standard library (real text nobody here
   wrote), a byte-level BPE of the tiny model's vocabulary trained on it by
   ``data_prep.train_tokenizer``, and Megatron indexed shards written by ``data_prep``;
2. the plan of the demo run (and of the 16,384-GPU Llama 3 70B experiment, for scale);
3. ``launcher.train``: the tiny model on ``cluster.gpus_per_node`` processes (2 on CPU) until the
   loss has clearly fallen, with checkpoints;
4. ``launcher.train`` again with a larger step budget: it resumes from the latest checkpoint;
5. where the run directory is, and how far the loss fell.

Every step is the real command a user would type, run as a subprocess.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from rich.console import Console

console = Console()
ROOT = Path("outputs")
DEMO_DIR = ROOT / "demo_data"
RUN_NAME = "demo"
FIRST_STEPS, MORE_STEPS = 100, 20


def command_line(args: list[str]) -> str:
    """The shell command a user would type for ``python args``, quoted so that it runs as is."""
    return "$ python " + shlex.join(args)


def run(title: str, args: list[str]) -> None:
    console.rule(f"[bold]{title}[/]")
    console.print(command_line(args), style="dim", markup=False, highlight=False, soft_wrap=True)
    proc = subprocess.run([sys.executable, *args])
    if proc.returncode != 0:
        console.print(f"[red]demo: step failed with exit code {proc.returncode}[/]")
        raise SystemExit(proc.returncode)


def prepare_corpus() -> list[str]:
    """Tokenizer + shards; returns the overrides that point training at them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = DEMO_DIR / "tokenizer.json"
    if not tokenizer.exists():
        run("train a 4,096-token byte-level BPE on the standard library",
            ["-m", "data_prep.train_tokenizer", "--input", str(stdlib / "*.py"),
             "--vocab-size", "4096", "--output", str(tokenizer)])
    run("tokenize the standard library into Megatron indexed shards",
        ["-m", "data_prep", f"input={stdlib / '*.py'}", f"output={DEMO_DIR / 'shards'}",
         "format=text", "text_unit=file", "tokenizer.kind=hf", f"tokenizer.path={tokenizer}",
         "progress=false"])
    data_conf = (DEMO_DIR / "shards" / "conf").resolve()
    return [f"hydra.searchpath=[file://{data_conf}]", "data=shards"]


def loss_summary(run_dir: Path) -> tuple[float, float, int]:
    """(loss at the first logged step, mean of the last three logged, last step)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("loss") is not None]
    return steps[0]["loss"], sum(r["loss"] for r in steps[-3:]) / 3, steps[-1]["step"]


def task_summary(run_dir: Path) -> str:
    """The last downstream-task line of the run, as 'task metric value, ...'."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "eval/tokens" in r]
    if not scored:
        return ""
    return ", ".join(f"{k.split('/')[1]} {k.split('/')[2]} {v:.3g}" for k, v in scored[-1].items()
                     if k.count("/") == 2 and not k.endswith("/examples"))


def main() -> int:
    train = ["trainer.eval_interval=40", "trainer.save_interval=60", "trainer.log_interval=5",
             "eval=demo",  # the shipped downstream tasks every 50 steps and at the end
             "optimizer.warmup_steps=10", "optimizer.lr=2e-3", "optimizer.min_lr=2e-4",
             f"run.name={RUN_NAME}", f"run.output_root={ROOT}", *sys.argv[1:]]
    data = prepare_corpus()
    run("plan of the demo run", ["-m", "launcher.plan", *data, *train,
                                 f"trainer.train_steps={FIRST_STEPS}"])
    run("for scale: Llama 3 70B on 16,384 H100", ["-m", "launcher.plan",
                                                   "experiment=llama3_70b_16k_h100"])
    shutil.rmtree(ROOT / RUN_NAME, ignore_errors=True)  # the demo's own run starts fresh
    run(f"train the tiny model for {FIRST_STEPS} steps",
        ["-m", "launcher.train", *data, *train, f"trainer.train_steps={FIRST_STEPS}"])
    run(f"resume from the latest checkpoint for {MORE_STEPS} more steps",
        ["-m", "launcher.train", *data, *train,
         f"trainer.train_steps={FIRST_STEPS + MORE_STEPS}"])
    run_dir = ROOT / RUN_NAME
    first, last, step = loss_summary(run_dir)
    console.rule("[bold]done[/]")
    console.print(f"loss fell from {first:.2f} (first logged step) to {last:.2f} (last three), "
                  f"{step} steps; run directory: {run_dir.resolve()}")
    scores = task_summary(run_dir)
    if scores:
        console.print(f"downstream tasks at step {step}: {scores}", markup=False,
                      highlight=False)
    console.print(f"report (open it in a browser): {(run_dir / 'report.html').resolve()}",
                  markup=False, highlight=False, soft_wrap=True)
    if not last < first - 1.0:
        console.print("[red]demo: the loss did not fall clearly[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
