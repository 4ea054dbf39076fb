"""How fast a hung or dead rank is found and the job trains again (2 CPU ranks, tiny model).

    .venv/bin/python bench/restart_latency.py [--runs 3]

Per run: a 2-rank ``launcher.train`` saving every 5 steps; at step 12 rank 1 is stopped
(SIGSTOP, ``resilience.hang_timeout_s=5``) or killed (SIGKILL). Read back from the run's
events.jsonl and metrics.jsonl:

* detection: signal -> the ``hang`` event (SIGSTOP; the timeout is part of it) or the
  ``attempt_end`` event (SIGKILL);
* restart to first step: that event -> the first step line of the next attempt, and of it the
  checkpoint load (the ``checkpoint ... loaded`` event's seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=512",
        "model.seq_length=64", "trainer.precision=fp32", "trainer.micro_batch_size=2",
        "data.num_workers=1", "trainer.train_steps=30", "trainer.save_interval=5",
        "trainer.eval_interval=0", "trainer.global_batch_size=8"]


def _rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_run(root: Path, sig: signal.Signals) -> dict:
    name = f"r{sig.name.lower()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    args = [sys.executable, "-m", "launcher.train", *TINY, f"run.output_root={root}",
            f"run.name={name}", "resilience.hang_timeout_s=5"]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    run_dir = root / name
    while not any(r.get("step") == 12 for r in _rows(run_dir / "metrics.jsonl")):
        time.sleep(0.02)
    sent = time.time()
    os.kill(int((run_dir / "logs" / "rank_1.pid").read_text()), sig)
    if proc.wait(timeout=300) != 0:
        raise SystemExit(f"{name}: the run did not finish")
    events = _rows(run_dir / "events.jsonl")
    found = next(e for e in events if e["kind"] == ("hang" if sig == signal.SIGSTOP
                                                    else "attempt_end"))
    second = next(e for e in events if e["kind"] == "attempt_start" and e["attempt"] == 1)
    loaded = next(e for e in events if e["kind"] == "checkpoint" and "loaded" in e["message"]
                  and e["time"] > second["time"])
    first_step = min(r["time"] - r["step_time"] for r in _rows(run_dir / "metrics.jsonl")
                     if r["time"] > second["time"])
    return {"detect_s": found["time"] - sent, "restart_s": first_step - found["time"],
            "load_s": loaded["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        results = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(one_run(Path(tmp), sig))
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(f"{sig.name}: detection {med['detect_s']:.2f} s, restart to first step "
              f"{med['restart_s']:.2f} s (checkpoint load {med['load_s']:.3f} s); median of "
              f"{args.runs}: " + "; ".join(f"{r['detect_s']:.2f}/{r['restart_s']:.2f}"
                                         for r in results))


if __name__ == "__main__":
    main()
