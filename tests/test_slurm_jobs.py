"""Training jobs on the real one-node Slurm of this machine (.ci/slurm_up.sh): the tiny recipe
through ``sbatch``, ``launcher.submit`` with hostile override values, and preemption (the
early-warning signal -> save -> ``scontrol requeue`` -> resume into the same run directory and
wandb run with no step lost or repeated)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.slurm import (REPO, SMALL, job_env, job_info, read_logs, sbatch,
                                 start_requeued_job_now, submit, wait_job)
from tests.helpers.submit import HOSTILE, hydra_quote

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
            .splitlines() if "loss" in json.loads(line)]


def test_tiny_recipe_via_sbatch_trains_to_completion(slurm, tmp_path):
    run_dir = tmp_path / "tiny_1x2_cpu"
    job = sbatch(f"--output={tmp_path}/slurm-%j.out", f"--error={tmp_path}/slurm-%j.err",
                 str(REPO / "recipes" / "tiny_1x2_cpu.sbatch"), f"run.output_root={tmp_path}",
                 *SMALL, env=job_env(), cwd=tmp_path)
    info = wait_job(job, timeout=240, logs=tmp_path)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), read_logs(tmp_path)
    assert metric_steps(run_dir) == list(range(1, 21))
    env = json.loads((run_dir / "env.json").read_text())
    assert json.dumps(env).count('"WORLD_SIZE": "2"') >= 1  # two srun tasks formed one world
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000020"


def test_submit_runs_with_hostile_overrides_arriving_unchanged(slurm, tmp_path):
    tags = f"logger.tags=[{hydra_quote(HOSTILE)},plain]"
    job = submit(tmp_path, f"data.tokenizer_path={hydra_quote(HOSTILE)}", tags, env=job_env())
    run_dir = tmp_path / "tiny_1x2_cpu"
    info = wait_job(job, timeout=240, logs=run_dir / "logs")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), read_logs(run_dir /
                                                                                   "logs")
    assert (run_dir / "submit.sbatch").is_file() and metric_steps(run_dir)[-1] == 20
    assert (run_dir / "checkpoints" / "step_000020" / "complete").is_file()
    import yaml
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["data"]["tokenizer_path"] == HOSTILE
    assert config["logger"]["tags"] == [HOSTILE, "plain"]
    assert not list(tmp_path.rglob("PWNED*")) and not list(REPO.glob("PWNED*"))


def wait_for_steps(run_dir: Path, job: str, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and path.read_text().count('"loss"') >= n:
            return
        assert job_info(job).get("JobState") in ("PENDING", "RUNNING"), read_logs(run_dir / "logs")
        time.sleep(0.1)
    pytest.fail(f"job {job} logged fewer than {n} steps in {timeout}s")


def test_preemption_signal_saves_requeues_and_resumes_the_same_run(slurm, tmp_path):
    run_dir = tmp_path / "tiny_1x2_cpu"
    job = submit(tmp_path, "trainer.train_steps=200", "trainer.save_interval=0",
                 "trainer.eval_interval=0", "logger=wandb", "logger.mode=offline",
                 env=job_env(WANDB_MODE="offline"))
    wait_for_steps(run_dir, job, 5)
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    deadline = time.monotonic() + 120
    while job_info(job).get("Restarts", "0") == "0" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_info(job)["Restarts"] == "1", read_logs(run_dir / "logs")
    start_requeued_job_now(job)
    info = wait_job(job, timeout=240, logs=run_dir / "logs")
    logs = read_logs(run_dir / "logs")
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), logs
    assert "requeueing job" in logs and "restart 1 on" in logs
    assert metric_steps(run_dir) == list(range(1, 201))  # no step lost or repeated
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    stop = next(e for e in events if e["kind"] == "stop")
    resume = next(e for e in events if e["kind"] == "resume")
    saved = int(stop["message"].split("saving at step ")[1].split()[0])
    assert f"at step {saved}" in resume["message"] and 5 <= saved < 200
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    wandb_id = (run_dir / "wandb_id").read_text().strip()
    assert len(runs) == 2 and all(r.name.endswith(wandb_id) for r in runs)  # same wandb run


def test_a_job_failing_for_another_reason_is_not_requeued(slurm, tmp_path):
    job = submit(tmp_path, f"trainer.load={tmp_path}/no_such_checkpoint", env=job_env())
    run_dir = tmp_path / "tiny_1x2_cpu"
    info = wait_job(job, timeout=240, logs=run_dir / "logs")
    logs = read_logs(run_dir / "logs")
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", logs
    assert info["ExitCode"] != "0:0" and "requeueing" not in logs


def test_a_rank_killed_inside_the_allocation_is_restarted_in_the_same_job(slurm, tmp_path):
    """The default launch.mode=torchrun: the node's agent restarts its ranks (torch elastic) from the
    latest checkpoint; Slurm sees one job, never requeued, that completes."""
    run_dir = tmp_path / "tiny_1x2_cpu"
    job = submit(tmp_path, "trainer.train_steps=30",
                 "trainer.save_interval=5", "trainer.eval_interval=0", env=job_env())
    wait_for_steps(run_dir, job, 12)
    pid = int((run_dir / "logs" / "rank_1.pid").read_text())
    subprocess.run(["kill", "-9", str(pid)], check=True, timeout=30)
    info = wait_job(job, timeout=300, logs=run_dir / "logs")
    logs = read_logs(run_dir / "logs")
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), logs
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    ends = [e for e in events if e["kind"] == "attempt_end"]
    assert "rank 1 died (SIGKILL)" in ends[0]["message"] and ends[0]["restart"] is True
    assert [e for e in events if e["kind"] == "resume"]
    assert max(metric_steps(run_dir)) == 30


def wait_for_step_start(job: str, run_dir: Path, timeout: float = 120) -> None:
    """Until the job's training step (srun) runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"],
                               capture_output=True, text=True, timeout=30).stdout.split()
        if f"{job}.0" in steps:
            return
        assert job_info(job).get("JobState") in ("PENDING", "RUNNING"), read_logs(run_dir / "logs")
        time.sleep(0.05)
    pytest.fail(f"job {job} started no step in {timeout}s")


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_a_stop_signal_in_start_up_requeues_and_the_job_then_trains_every_step(slurm, tmp_path,
                                                                             mode):
    """The early warning (``scancel --signal=USR1``, to every task of the step) 1 s after the
    training step starts: the launcher or the ranks are still starting, nothing to save; the job
    exits 75 with one line and requeues itself, and the requeued job trains every step (issue
    44). ``torchrun``: one agent per node, exec'd into launcher.train; ``srun``: each task is a
    rank."""
    run_dir = tmp_path / "tiny_1x2_cpu"
    job = submit(tmp_path, "trainer.train_steps=10", "trainer.save_interval=0",
                 "trainer.eval_interval=0", f"launch.mode={mode}", env=job_env())
    wait_for_step_start(job, run_dir)
    time.sleep(1.0)
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    deadline = time.monotonic() + 120
    while job_info(job).get("Restarts", "0") == "0" and time.monotonic() < deadline:
        time.sleep(0.2)
    logs = read_logs(run_dir / "logs")
    assert job_info(job)["Restarts"] == "1", logs
    assert logs.count("stopped by SIGUSR1 during start-up") == 1 and "requeueing job" in logs, logs
    assert not (run_dir / "metrics.jsonl").exists() or not metric_steps(run_dir), logs
    start_requeued_job_now(job)
    info = wait_job(job, timeout=240, logs=run_dir / "logs")
    logs = read_logs(run_dir / "logs")
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), logs
    assert metric_steps(run_dir) == list(range(1, 11))
