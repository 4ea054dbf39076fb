"""Sweeps: ``launcher.train -m`` locally and through the Slurm launcher (hydra-submitit) give one
run directory per point named after its overrides, a shared wandb group, and a summary table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launcher.launch.sweep import split_overrides, time_limit_minutes
from launcher.sweep_summary import main as summary_main, summarize
from tests.helpers.slurm import job_env, job_info, start_requeued_job_now
from tests.helpers.training import REPO, TINY

POINTS = ["optimizer.lr=1e-4,3e-3", *(o for o in TINY if not o.startswith("optimizer.lr=")), "trainer.train_steps=6", "trainer.eval_interval=3",
          "trainer.save_interval=0", "trainer.straggler_interval=0"]


def sweep(tmp: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = env or {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                  "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "launcher.train", "-m", *POINTS,
                           f"run.output_root={tmp}", "run.name=lr_sweep", *overrides],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def check_points(sweep_dir: Path) -> None:
    names = sorted(p.parent.name for p in sweep_dir.glob("*/metrics.jsonl"))
    assert names == ["optimizer.lr=0.0001", "optimizer.lr=0.003"]
    for name in names:
        config = yaml.safe_load((sweep_dir / name / "config.yaml").read_text())
        assert config["logger"]["group"] == "lr_sweep"
        assert config["optimizer"]["lr"] == float(name.split("=")[1])
    rows = summarize(sweep_dir)
    assert [r["point"] for r in rows] == ["optimizer.lr=0.003", "optimizer.lr=0.0001"]
    assert all(r["steps"] == 6 and r["best_val_step"] in (3, 6) for r in rows)


@pytest.mark.slow
def test_local_multirun_one_run_dir_per_point_and_shared_group(tmp_path):
    proc = sweep(tmp_path)
    check_points(tmp_path / "lr_sweep")
    # the sweep's report, written when it ends
    assert f"[report] {tmp_path / 'lr_sweep' / 'report.html'}" in proc.stderr
    assert "optimizer.lr=0.003" in (tmp_path / "lr_sweep" / "report.html").read_text()


OPTUNA = ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
          "hydra.sweeper.sampler.seed=7", "optimizer.lr=interval(1e-4,3e-3)",
          *(o for o in TINY if not o.startswith("optimizer.lr=")), "trainer.train_steps=6",
          "trainer.eval_interval=3", "trainer.save_interval=0", "trainer.straggler_interval=0"]


@pytest.mark.slow
def test_optuna_sweeper_gets_each_points_final_validation_loss(tmp_path):
    """Hydra's real Optuna sweeper, 3 trials: each point returns its final validation loss
    (before, launcher.train's task returned None and Hydra failed with "Return value must be
    float-castable"); Optuna's best value is the best point's, which the report marks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "launcher.train", "-m", *OPTUNA,
                           f"run.output_root={tmp_path}", "run.name=study"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    study = tmp_path / "study"
    results = yaml.safe_load((study / "optimization_results.yaml").read_text())
    finals = {}
    for point in sorted(p.parent for p in study.glob("*/metrics.jsonl")):
        evals = [json.loads(x)["eval/loss"] for x in (point / "metrics.jsonl").read_text()
                 .splitlines() if "eval/loss" in x]
        finals[point.name] = evals[-1]
    assert len(finals) == 3
    best = min(finals, key=finals.get)
    assert results["best_value"] == pytest.approx(finals[best])
    assert results["best_params"]["optimizer.lr"] == pytest.approx(float(best.split("=")[1]))
    assert summarize(study)[0]["point"] == best
    assert f"best: {best}" in (study / "report.html").read_text()


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_slurm_launcher_runs_one_job_per_point(slurm, tmp_path):
    sweep(tmp_path, "hydra/launcher=slurm", "cluster=slurm_cpu", env=job_env())
    check_points(tmp_path / "lr_sweep")
    scripts = list((tmp_path / "lr_sweep" / ".submitit").glob("*/*_submission.sh"))
    text = scripts[0].read_text() if scripts else ""
    assert "#SBATCH --cpus-per-task=2" in text
    # the stop contract of single runs: trainer.stop_signal at cluster.signal_lead_s, requeueable
    assert "#SBATCH --signal=USR1@60" in text and "#SBATCH --requeue" in text


LONG_POINT = ["optimizer.lr=choice(0.001)", *(o for o in TINY if not o.startswith("optimizer.lr=")),
              "trainer.train_steps=150", "trainer.eval_interval=0", "trainer.save_interval=0",
              "trainer.straggler_interval=0", "run.name=stop_sweep"]


def start_sweep(tmp: Path, *overrides: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.train", "-m", *LONG_POINT,
                             f"run.output_root={tmp}", *overrides], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_losses(metrics: Path, n: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count('"loss"') >= n:
            return
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no {n} steps in {metrics} (sweep exit {proc.poll()}):\n"
                f"{proc.stdout.read()[-4000:]}")


def logged_steps(run_dir: Path) -> list[int]:
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [l["step"] for l in lines if "loss" in l]


@pytest.mark.slow
def test_a_stopped_local_sweep_exits_75_and_the_same_command_resumes_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    run_dir = tmp_path / "stop_sweep" / "optimizer.lr=0.001"
    proc = start_sweep(tmp_path, env=env)
    wait_for_losses(run_dir / "metrics.jsonl", 5, proc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole group, the sweep process included
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-4000:]
    assert "run the same sweep again to resume it" in out
    saved = max(logged_steps(run_dir))
    assert (run_dir / "checkpoints" / f"step_{saved:06d}" / "complete").exists()
    again = start_sweep(tmp_path, env=env)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out[-4000:]
    assert logged_steps(run_dir) == list(range(1, 151))  # no step lost or repeated


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_a_slurm_sweep_point_saves_at_its_warning_requeues_and_resumes(slurm, tmp_path):
    run_dir = tmp_path / "stop_sweep" / "optimizer.lr=0.001"
    proc = start_sweep(tmp_path, "hydra/launcher=slurm", "cluster=slurm_cpu", env=job_env())
    wait_for_losses(run_dir / "metrics.jsonl", 5, proc)
    job = next(p.name for p in (tmp_path / "stop_sweep" / ".submitit").iterdir()
               if p.is_dir())  # submitit's folder per job: <id> (<id>_<task> in arrays)
    # what submitit's time-limit warning does: the stop signal to the job's steps
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    deadline = time.monotonic() + 120
    while job_info(job).get("Restarts", "0") == "0" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_info(job).get("Restarts") == "1", job_info(job)
    start_requeued_job_now(job)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-4000:]
    assert logged_steps(run_dir) == list(range(1, 151))
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events if e["kind"] in ("stop", "resume")] == ["stop", "resume"]


def test_sweep_keys_and_time_limits():
    assert split_overrides(["a.b=1,2", "c=3", "d=range(1,3)"]) == (["a.b", "d"], ["c=3"])
    assert [time_limit_minutes(t) for t in ("00:15:00", "1-00:00:30", "90", "48:00:00")] == \
        [15, 1441, 90, 2880]


def test_summary_tabulates_final_and_best_validation_loss(tmp_path, capsys):
    for name, evals in {"lr=1": [3.0, 2.0, 2.5], "lr=2": [2.9, 1.5, 1.7], "lr=3": []}.items():
        (tmp_path / name).mkdir()
        lines = [{"step": s, "loss": 4.0 - s / 10} for s in range(1, 4)]
        lines += [{"step": s + 1, "eval/loss": v} for s, v in enumerate(evals)]
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(l) + "\n" for l in lines) + '{"step": 9, "lo')
    rows = summarize(tmp_path)
    assert [(r["point"], r["final_val_loss"], r["best_val_loss"], r["best_val_step"])
            for r in rows] == [("lr=2", 1.7, 1.5, 2), ("lr=1", 2.5, 2.0, 2),
                               ("lr=3", None, None, None)]
    assert summary_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["point", "steps", "train_loss", "final_val_loss", "best_val_loss",
                              "best_val_step"]
    assert out[1].split()[:5] == ["lr=2", "3", "3.7000", "1.7000", "1.5000"]
    assert summary_main([str(tmp_path / "lr=3" / "none")]) == 1


def test_objective_is_the_final_validation_loss_else_the_final_training_loss(tmp_path):
    from launcher.launch.sweep import objective_of

    lines = [{"step": 1, "loss": 5.0}, {"step": 1, "eval/loss": 5.5},
             {"step": 2, "loss": 4.0}, {"step": 2, "eval/loss": 4.5}, {"step": 3, "loss": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines)
                                            + '{"step": 4, "lo')  # cut by a crash
    assert objective_of(tmp_path) == 4.5
    assert objective_of(tmp_path, "val_loss") == 4.5
    assert objective_of(tmp_path, "train_loss") == 3.0
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    assert objective_of(tmp_path) == 5.0
    with pytest.raises(ValueError, match="set trainer.eval_interval"):
        objective_of(tmp_path, "val_loss")
