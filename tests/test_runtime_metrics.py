"""metrics.py: metrics.jsonl / events.jsonl / console on rank 0 only; wandb offline run inside the
run directory, resumed under the same id by a restarted process; no secret reaches any file or the
console.

The wandb tests run this file as a script (``__main__`` guard below): each start is a fresh process,
as after a requeue.
"""

from __future__ import annotations

import json
import time
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import LoggerConfig
from launcher.core.phases import PHASES, PhaseTimer
from launcher.runtime.metrics import (MetricsLogger, NullMetricsLogger, make_metrics_logger,
                                      progress_line, timer_metrics)
from tests.helpers.wandb_runs import wandb_records

REPO_ROOT = Path(__file__).resolve().parent.parent


def _step_metrics(step: int, fused: bool = False) -> dict:
    timer = PhaseTimer()
    if fused:
        timer.rename("backward", "backward+grad_sync")
    for phase in ("data", "forward", "backward", "optimizer"):
        timer.add(phase, 0.01 * (step + 1))
    return {"loss": 3.0 / (step + 1), "lr": 3e-4, "grad_norm": 1.5, "loss_scale": 1.0,
            "tokens_per_s": 4096.0, "consumed_samples": 8 * (step + 1),
            **timer_metrics(timer.snapshot())}


def test_metrics_jsonl_and_console(tmp_path, capsys):
    metrics = make_metrics_logger(0, run_dir=tmp_path, logger=LoggerConfig(), run_name="r",
                                  config={})
    assert isinstance(metrics, MetricsLogger)
    before = time.time()
    with metrics:
        for step in range(1, 4):
            metrics.log(step, _step_metrics(step, fused=step == 3))
        metrics.log(4, {"loss": float("nan"), "grad_norm": float("inf"), "time/data": 0.1})
        metrics.log(4, {"eval/loss": 2.5})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 4]
    assert all(before - 0.01 <= line.pop("time") <= time.time() + 0.01 for line in lines)
    assert lines.pop() == {"step": 4, "eval/loss": 2.5}  # not a step record: no phase keys
    assert all(next(iter(line)) == "step" for line in lines)
    for line in lines[:2] + lines[3:]:
        assert {f"time/{p}" for p in PHASES} <= set(line)
    assert "time/backward+grad_sync" in lines[2] and "time/backward" not in lines[2]
    assert lines[2]["time/grad_sync"] == 0.0
    assert lines[0]["time/forward"] == pytest.approx(0.02) and lines[0]["time/loss"] == 0.0
    assert lines[3]["loss"] is None and lines[3]["grad_norm"] is None
    assert list(lines[0]) == list(lines[1])  # stable keys from step to step
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 1 | loss 1.5000 | lr 3.000e-04 | gnorm 1.500 | tok/s 4,096")
    assert "forward 0.020" in out[0] and "backward+grad_sync 0.040" in out[2]
    assert out[3].startswith("step 4 | loss nan")


def test_events_jsonl_and_console(tmp_path, capsys):
    with make_metrics_logger(0, run_dir=tmp_path, logger=LoggerConfig(), run_name="r",
                             config={}) as metrics:
        metrics.log_event("loss_spike", "loss 9.1 > 3.0 x recent max 2.9", step=7, loss=9.1)
        metrics.log_event("straggler", "rank 3 slow", stragglers=[{"rank": 3, "ratio": 1.9}])
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e.get("step")) for e in events] == [("loss_spike", 7), ("straggler", None)]
    assert events[1]["stragglers"] == [{"rank": 3, "ratio": 1.9}]
    assert "[loss_spike] loss 9.1 > 3.0 x recent max 2.9 (step=7 loss=9.1)" in \
        capsys.readouterr().out


def test_other_ranks_get_null_logger(tmp_path, capsys):
    metrics = make_metrics_logger(1, run_dir=tmp_path / "r", logger=LoggerConfig(name="wandb"),
                                  run_name="r", config={})
    assert isinstance(metrics, NullMetricsLogger) and not isinstance(metrics, MetricsLogger)
    metrics.log(1, {"loss": 1.0})
    metrics.log_event("nan_skip", "skipped")
    metrics.close()
    assert not (tmp_path / "r").exists() and capsys.readouterr().out == ""


def test_unknown_logger_name(tmp_path):
    with pytest.raises(ValueError, match="logger.name='tensorboard'"):
        make_metrics_logger(0, run_dir=tmp_path, logger=LoggerConfig(name="tensorboard"),
                            run_name="r", config={})


def test_progress_line_skips_missing_and_zero_phases():
    line = progress_line(5, {"loss": 2.0, "time/data": 0.0, "time/forward": 0.5})
    assert line == "step 5 | loss 2.0000 | s: forward 0.500"


# --- wandb offline, in fresh processes -------------------------------------------------------

def _history(path: Path) -> tuple[str, list[dict]]:
    """(run id, history rows) of one offline run file."""
    run_id, rows = "", []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, rows


def _start(run_dir: Path, first_step: int, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, __file__, str(run_dir), str(first_step)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_wandb_offline_resume_and_no_secret_anywhere(tmp_path):
    key = secrets.token_hex(20)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_API_KEY=key, TW_TEST_SECRET=key,
               WANDB_CONFIG_DIR=str(tmp_path / "home" / "config"),
               WANDB_CACHE_DIR=str(tmp_path / "home" / "cache"),
               WANDB_DATA_DIR=str(tmp_path / "home" / "data"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    env.pop("WANDB_DIR", None)
    run_dir = tmp_path / "run"
    first, second = _start(run_dir, 1, env), _start(run_dir, 4, env)  # a start, then a restart

    run_id = (run_dir / "wandb_id").read_text().strip()
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    for path, steps in zip(files, ([1, 2, 3], [4, 5, 6])):
        file_id, rows = _history(path)
        assert file_id == run_id
        assert [row["_step"] for row in rows] == steps
        assert [row["loss"] for row in rows] == pytest.approx([3.0 / (s + 1) for s in steps])
        assert all(f"time/{p}" in rows[0] for p in PHASES)
    logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]

    assert "step 1 |" in first.stdout and "step 4 |" in second.stdout
    for proc in (first, second):
        assert key not in proc.stdout and key not in proc.stderr
        assert "sk-live" not in proc.stdout + proc.stderr
    checked = 0
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert key.encode() not in data, f"secret written to {path}"
            assert b"sk-live" not in data, f"config secret written to {path}"
            checked += 1
    assert checked >= 8
    events = (run_dir / "events.jsonl").read_text()
    assert events.count("<redacted>") == 6  # message, api_key field, detail; in both starts


def _script_main(run_dir: str, first_step: int) -> None:
    """One start of a run: wandb offline logger, 3 steps, an event, close."""
    key = os.environ["TW_TEST_SECRET"]
    config = {"logger": {"name": "wandb", "api_key": "sk-live-0123456789"},
              "note": f"https://user:{key}@example.com", "trainer": {"seed": 1}}
    logger = LoggerConfig(name="wandb", project="tw-test", tags=["test"], mode="online")
    metrics = make_metrics_logger(0, run_dir=Path(run_dir), logger=logger, run_name="tiny_cpu",
                                  config=config, group="g")
    for step in range(first_step, first_step + 3):
        metrics.log(step, _step_metrics(step))
    metrics.log_event("nan_skip", f"token {key} leaked?", api_key=key,
                      detail=f"x{key}x")
    metrics.close()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    _script_main(sys.argv[1], int(sys.argv[2]))


def test_progress_line_shows_eval_loss_and_perplexity():
    line = progress_line(40, {"eval/loss": 6.44, "eval/perplexity": 627.3})
    assert line == "step 40 | eval loss 6.4400 | ppl 627.3"
