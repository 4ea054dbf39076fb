"""Every checkpoint scored in its own job (issue 37, eval.asynchronous): started through the run's
launch path (a local process, a real Slurm job, a Kubernetes Job), never waited on by the
training, each checkpoint's scores in metrics.jsonl and wandb exactly once across a resume,
equal to ``launcher.evaluate`` on the same checkpoint; a checkpoint pruned by keep-k before its
turn skipped with an event; a merge cut off before its marker not merged twice."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launcher.config import LoggerConfig
from launcher.evals import ledger
from launcher.runtime.eval_jobs import merge_results
from launcher.runtime.metrics import MetricsLogger
from tests.helpers.data_prep import train_hf_tokenizer
from tests.helpers.training import REPO, TINY, train
from tests.helpers.wandb_runs import wandb_history

TASKS = ["eval.tasks=[tw_facts,tw_paragraphs]", "eval.limit=8"]
ONE_PROCESS = "eval.job_overrides=['cluster.gpus_per_node=1']"
ASYNC = [*TASKS, "eval.async=true", ONE_PROCESS, "engine=megatron"]
TOKENS_PER_STEP = 2 * 2 * 64  # micro-batch 2 x 2 replicas x sequence 64


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_hf_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=500)


def worker_busy(run_dir: Path) -> bool:
    path = ledger.evals_dir(run_dir) / "worker.lock"
    if not path.exists():
        return False
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def local_jobs(run_dir: Path) -> list[int]:
    """The pids of the local eval jobs the run started (its eval_job events)."""
    return [int(e["message"].split("local process ")[1].split()[0])
            for e in events(run_dir, "eval_job") if "local process " in e["message"]]


def wait_settled(run_dir: Path, steps: list, timeout: float = 240) -> None:
    """Until every step is merged or skipped and no eval job is at work."""
    evals, deadline = ledger.evals_dir(run_dir), time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = all((evals / f"step_{s:06d}.merged").exists()
                   or (evals / f"step_{s:06d}.skipped.json").exists() for s in steps)
        if done and not worker_busy(run_dir) and not (run_dir / "run.lock").exists() \
                and not [p for p in local_jobs(run_dir) if Path(f"/proc/{p}").exists()]:
            return
        time.sleep(0.5)
    log = evals / "worker.log"
    pytest.fail(f"steps {steps} not settled in {timeout}s: {sorted(os.listdir(evals))}\n"
                + (log.read_text()[-4000:] if log.exists() else "no worker.log"))


def merged_lines(run_dir: Path) -> list:
    return [row for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if ledger.ASYNC_KEY in (row := json.loads(line))]


def events(run_dir: Path, kind: str) -> list:
    return [e for line in (run_dir / "events.jsonl").read_text().splitlines()
            if (e := json.loads(line))["kind"] == kind]


def evaluate_json(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "launcher.evaluate", *args, "eval.format=json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_checkpoint_scored_once_across_a_resume_in_the_same_wandb_run(tmp_path, tokenizer):
    common = [*ASYNC, f"eval.tokenizer={tokenizer}", "trainer.save_interval=2",
              "trainer.keep_last=0", "logger=wandb"]
    offline = {"WANDB_MODE": "offline"}
    run_dir = tmp_path / "a"
    first = train(tmp_path, "a", *common, "trainer.train_steps=4", env=offline)
    assert "tw_facts acc" not in first.stdout  # nothing scored in the loop
    wait_settled(run_dir, [2, 4])
    train(tmp_path, "a", *common, "trainer.train_steps=6", env=offline)
    wait_settled(run_dir, [2, 4, 6])

    lines = merged_lines(run_dir)
    assert sorted(r[ledger.ASYNC_KEY] for r in lines) == [2, 4, 6]  # each once, none lost
    assert all(r["step"] == r[ledger.ASYNC_KEY] for r in lines)
    assert all(r["eval/tokens"] == r["step"] * TOKENS_PER_STEP for r in lines)
    plan = json.loads((run_dir / "plan.json").read_text())["downstream"]
    assert plan["evaluations"] == 0 and plan["jobs"] == 3  # steps 2, 4, 6; none in the loop

    output = tmp_path / "scores" / "six.json"
    alone = evaluate_json(f"checkpoint={run_dir / 'checkpoints' / 'step_000006'}",
                          *TASKS, f"eval.tokenizer={tokenizer}", "cluster.gpus_per_node=1",
                          "trainer.precision=fp32", f"eval.output={output}")
    assert json.loads(output.read_text()) == alone and alone["step"] == 6
    [six] = [r for r in lines if r["step"] == 6]
    for task, row in alone["tasks"].items():
        assert six[f"eval/{task}/{'acc' if task == 'tw_facts' else 'examples'}"] == \
            row["acc" if task == "tw_facts" else "examples"]
        for metric, value in row.items():
            assert six[f"eval/{task}/{metric}"] == pytest.approx(value, rel=1e-5), metric

    wandb_id = (run_dir / "wandb_id").read_text().strip()
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert runs and all(r.name.endswith(wandb_id) for r in runs)  # one wandb run
    logged = [row[ledger.ASYNC_KEY] for r in runs for f in r.glob("run-*.wandb")
              for row in wandb_history(f) if ledger.ASYNC_KEY in row]
    assert sorted(logged) == [2, 4, 6]


@pytest.mark.slow
def test_checkpoints_pruned_before_their_turn_are_skipped_with_an_event(tmp_path, tokenizer):
    """The test holds the eval worker's lock while the run trains (an eval job busy elsewhere),
    so keep-k prunes steps 1-3 before any job gets to them; the job started after the run
    skips them, scores step 4 and, the run being over, merges it itself."""
    run_dir = tmp_path / "k"
    with ledger.worker_lock(run_dir) as mine:
        assert mine
        train(tmp_path, "k", *ASYNC, f"eval.tokenizer={tokenizer}", "trainer.train_steps=4",
              "trainer.save_interval=1", "trainer.keep_last=1")
    assert [r["step"] for r in ledger.pending(run_dir)] == [1, 2, 3, 4]
    started = [e["message"] for e in events(run_dir, "eval_job")]
    assert len(started) == 4 and all("already at work" in m for m in started)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "launcher.evaluate", f"checkpoint={run_dir}",
                           "eval.async=true", "cluster.gpus_per_node=1", "trainer.precision=fp32"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    skipped = events(run_dir, "eval_skipped")
    assert [e["step"] for e in skipped] == [1, 2, 3]
    assert all("removed before its turn" in e["message"] for e in skipped)
    assert [r["step"] for r in merged_lines(run_dir)] == [4]
    assert not ledger.pending(run_dir) and not (run_dir / "run.lock").exists()


def test_a_merge_cut_off_before_its_marker_is_not_merged_twice(tmp_path):
    ledger.request(tmp_path, step=2, tokens=512, checkpoint=tmp_path / "checkpoints" / "step_2")
    ledger.write_result(tmp_path, {"step": 2, "tokens": 512, "checkpoint": "x", "seconds": 1.0,
                                   "tasks": {"tw_facts": {"acc": 0.5}}})
    with MetricsLogger(tmp_path, LoggerConfig(), "r", {}) as metrics:
        assert merge_results(tmp_path, metrics) == 1
        assert merge_results(tmp_path, metrics) == 0
    (ledger.evals_dir(tmp_path) / "step_000002.merged").unlink()  # the cut-off merge
    with MetricsLogger(tmp_path, LoggerConfig(), "r", {}) as metrics:
        assert merge_results(tmp_path, metrics) == 0
    [line] = merged_lines(tmp_path)
    assert line["eval/tw_facts/acc"] == 0.5 and line["eval/tokens"] == 512 and line["step"] == 2
    assert not ledger.unmerged(tmp_path)


def test_eval_async_on_the_command_line_sets_the_field():
    from launcher.compose import compose_config, with_aliases

    assert compose_config(["eval.async=true"]).eval.asynchronous is True
    assert compose_config([]).eval.asynchronous is False
    assert with_aliases(["eval.async=true,false", "+eval.async=1", "eval.limit=2"]) == [
        "eval.asynchronous=true,false", "+eval.asynchronous=1", "eval.limit=2"]  # sweeps too


def test_a_training_launch_waits_for_an_eval_job_merging_into_its_run(tmp_path):
    from launcher.core import locks

    merger = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from launcher.core import locks; "
        f"locks.acquire(Path({str(tmp_path)!r}), role=locks.MERGE_ROLE); time.sleep(1.5); "
        f"locks.release(Path({str(tmp_path)!r}))")], cwd=REPO, env={**os.environ,
                                                                  "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 30
        while locks.holder(tmp_path) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert locks.holder(tmp_path).role == locks.MERGE_ROLE
        start = time.monotonic()
        assert locks.acquire(tmp_path) is None  # waited for the merge, then took the lock
        assert 0.3 < time.monotonic() - start < locks.MERGE_WAIT_S
        assert locks.holder(tmp_path).pid == os.getpid()
    finally:
        merger.wait(timeout=30)
        locks.release(tmp_path)


KUBECTL = """#!/bin/sh
echo "$@" > "$KUBECTL_LOG"
echo "job.batch/created"
"""


def test_on_kubernetes_a_checkpoint_starts_a_checked_batch_job(tmp_path, monkeypatch):
    from launcher.compose import compose_config, to_object
    from launcher.launch.eval_jobs import dispatcher
    from launcher.launch.kubernetes.checks import manifest_problems
    from launcher.plan import plan_or_exit

    cfg = to_object(compose_config(["cluster=k8s_cpu", *TASKS, "eval.async=true",
                                    "cluster.namespace=team-a"]))
    kubectl, log = tmp_path / "kubectl", tmp_path / "kubectl.args"
    kubectl.write_text(KUBECTL)
    kubectl.chmod(0o755)
    monkeypatch.setenv("TRAINWRIGHT_KUBECTL", str(kubectl))
    monkeypatch.setenv("KUBECTL_LOG", str(log))
    run_dir = tmp_path / "run"
    ledger.request(run_dir, step=100, tokens=1, checkpoint=run_dir / "checkpoints" / "s")
    what = dispatcher(cfg, plan_or_exit(cfg), run_dir)()
    manifest = ledger.evals_dir(run_dir) / "job_000100.yaml"
    assert str(manifest) in what
    assert log.read_text().split() == ["create", "-n", "team-a", "-f", str(manifest)]
    [job] = list(yaml.safe_load_all(manifest.read_text()))
    assert job["kind"] == "Job" and manifest_problems([job]) == []
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:6] == ["python", "-u", "-m", "launcher.evaluate", f"checkpoint={run_dir}",
                           "eval.asynchronous=true"]


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_under_slurm_each_checkpoint_starts_an_eval_job_of_its_own(slurm, tmp_path, tokenizer):
    from tests.helpers.slurm import job_env, read_logs, submit, wait_job

    run_dir = tmp_path / "tiny_1x2_cpu"
    job = submit(tmp_path, *TASKS, "eval.async=true", ONE_PROCESS, f"eval.tokenizer={tokenizer}",
                 "trainer.train_steps=4", "trainer.save_interval=2", "trainer.keep_last=0",
                 "trainer.eval_interval=0", env=job_env())
    info = wait_job(job, timeout=240, logs=run_dir / "logs")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), read_logs(run_dir /
                                                                                   "logs")
    started = [e["message"] for e in events(run_dir, "eval_job") if "scored by" in e["message"]]
    eval_jobs = [m.split("Slurm job ")[1].split()[0] for m in started]
    assert len(eval_jobs) == 2, started  # one per checkpoint, sbatch-ed by the run's rank 0
    for eval_job in eval_jobs:
        done = wait_job(eval_job, timeout=240, logs=ledger.evals_dir(run_dir))
        assert (done["JobState"], done["ExitCode"]) == ("COMPLETED", "0:0"), done
    wait_settled(run_dir, [2, 4], timeout=60)
    assert sorted(r["step"] for r in merged_lines(run_dir)) == [2, 4]
    script = (ledger.evals_dir(run_dir) / "eval.sbatch").read_text()
    assert "#SBATCH --dependency=singleton" in script and "#SBATCH --job-name=tw_tiny_1x2_cpu_eval" \
        in script
