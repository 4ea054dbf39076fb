"""``python -m launcher.train logger=wandb`` offline with secrets in the environment (names the
filter must know: WANDB_API_KEY, HF_TOKEN, and names ending in KEY or PASS) and in config strings
on the command line (an env secret inside a path and a tag, and a Hugging Face token format that
no variable holds): the wandb offline run inside the run directory holds the metrics, and neither
the run directory (every file read as bytes: config.yaml, env.json, checkpoint metadata, wandb's
run file and debug.log) nor the captured console output contains a secret's value. Before the
fix OPENAI_KEY and DB_PASS were written in clear, and checkpoint metadata and wandb's stored
command line held every override verbatim."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from tests.helpers.training import REPO, TINY, steps_of
from tests.helpers.wandb_runs import wandb_history

STEPS = 4


@pytest.mark.slow
def test_wandb_offline_run_has_metrics_and_no_secret_is_written(tmp_path):
    api_key, hf_token = secrets.token_hex(20), secrets.token_urlsafe(30)
    openai_key, db_pass = secrets.token_urlsafe(24), secrets.token_urlsafe(16)
    in_config = "hf_" + secrets.token_hex(18)  # a token format, held by no secret variable
    assert len(api_key) == 40
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "offline",
           "WANDB_API_KEY": api_key, "HF_TOKEN": hf_token, "OPENAI_KEY": openai_key,
           "DB_PASS": db_pass}
    args = [sys.executable, "-m", "launcher.train", *TINY, f"run.output_root={tmp_path}",
            "run.name=wb", f"trainer.train_steps={STEPS}", "trainer.global_batch_size=8",
            "optimizer.warmup_steps=1", "trainer.eval_interval=0", "logger=wandb",
            f"logger.tags=[secret-check,offline,{db_pass}]",
            f"data.tokenizer_path=/models/{in_config}/{openai_key}/tokenizer.json"]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:].decode(errors="replace")
    run_dir = tmp_path / "wb"

    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((run_dir / "wandb").rglob("*"))
    assert runs[0].name == f"run-{(run_dir / 'wandb_id').read_text().strip()}.wandb"
    history = {row["_step"]: row for row in wandb_history(runs[0]) if "loss" in row}
    steps = steps_of(run_dir)
    assert sorted(history) == sorted(steps) == list(range(1, STEPS + 1))
    for step, row in steps.items():
        for key in ("loss", "grad_norm", "lr", "consumed_samples", "time/forward"):
            assert history[step][key] == pytest.approx(row[key], rel=1e-12), (step, key)

    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(files) > 10
    assert any(p.name == "trainwright.json" for p in files)  # checkpoint metadata is checked too
    assert any(p.name == "debug.log" for p in files)  # and wandb's own log
    for secret in (api_key, hf_token, openai_key, db_pass, in_config):
        needle = secret.encode()
        assert needle not in out
        leaked = [str(p) for p in files if needle in p.read_bytes()]
        assert not leaked, leaked
