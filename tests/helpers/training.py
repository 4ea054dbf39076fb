"""``python -m launcher.train`` as a subprocess on CPU: the tiny model's overrides (``TINY``), a
blocking run (``train``) and its metrics by step (``steps_of``).

Formerly in tests/test_train_loop.py, whose tests and those of many other modules use them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=512",
        "model.seq_length=64", "trainer.precision=fp32", "trainer.micro_batch_size=2",
        "optimizer.warmup_steps=2", "optimizer.lr=3e-3", "data.num_workers=1",
        "trainer.eval_iters=2", "trainer.straggler_interval=5",
        # the end-of-run HTML report costs about a second a run; its own tests turn it on
        "run.report=false"]


def train(tmp: Path, name: str, *overrides: str, expect: int = 0,
          env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m launcher.train`` of the tiny model (wandb disabled unless ``env`` says
    otherwise); asserts its exit code is ``expect``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO), **(env or {})}
    args = [sys.executable, "-m", "launcher.train", *TINY, f"run.output_root={tmp}",
            f"run.name={name}", *overrides]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def steps_of(run_dir: Path) -> dict:
    """metrics.jsonl training lines by step (evaluation lines are separate entries)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row
    return out
