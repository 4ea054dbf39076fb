"""The rendered TrainJob really runs: its pod template, started as 2 local "pods" x 1 process.

``python -m launcher.submit cluster=k8s_cpu cluster.nodes=2 ... submit.dry_run=true`` renders the
TrainingRuntime and the TrainJob; each pod runs exactly the template's command and environment
with the variables Kubeflow's Trainer injects (PET_*, master 127.0.0.1) in its own process
group and working directory, the volumes mapped to temp folders (tests/helpers/pods.py). The
pods train as one world; SIGTERM to one pod's main process (what the kubelet sends on a
preemption or drain) ends both pods with exit 75 and a checkpoint; starting the pods again (what
the JobSet's restart does) resumes, and the losses equal a straight run's bit for bit.
"""

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

from launcher.core.exits import REQUEUE_EXIT
from launcher.launch.kubernetes.pod import JOBSET_ATTEMPT_LABEL, JOBSET_UID_LABEL
from launcher.parallel.distributed import free_port
from tests.helpers.pods import start_pod
from tests.helpers.training import REPO, TINY, steps_of, train

pytestmark = pytest.mark.slow

STEPS = 12
RUN = [f"trainer.train_steps={STEPS}", "trainer.global_batch_size=8", "trainer.save_interval=0",
       "trainer.eval_interval=0", "trainer.straggler_interval=0"]


def render(*overrides: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "launcher.submit", *overrides,
                           "submit.dry_run=true"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return list(yaml.safe_load_all(proc.stdout))


def trainer_pet(trainjob: dict, port: int) -> dict:
    """What the Trainer's torch plugin injects into the ``node`` container (PET_NODE_RANK per
    pod is not read: the agents' c10d rendezvous assigns the ranks)."""
    t = trainjob["spec"]["trainer"]
    return {"PET_NNODES": t["numNodes"], "PET_NPROC_PER_NODE": t["numProcPerNode"],
            "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port}


def start_pods(tmp: Path, runtime: dict, trainjob: dict, attempt: int) -> tuple[list, list]:
    """Start every pod of JobSet restart ``attempt``: (processes, log paths)."""
    job = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    template = job["template"]
    volumes = {m["mountPath"]: tmp / m["name"] for m in template["spec"]["containers"][0]
               ["volumeMounts"] if m["name"] != "dshm"}
    for folder in volumes.values():
        folder.mkdir(exist_ok=True)
    pet, logs = trainer_pet(trainjob, free_port()), []
    pods = []
    for index in range(job["parallelism"]):
        logs.append(tmp / f"attempt{attempt}_pod{index}.log")
        labels = {JOBSET_UID_LABEL: "5f1c-uid", JOBSET_ATTEMPT_LABEL: str(attempt)}
        pods.append(start_pod(template, index=index, pet=pet, volumes=volumes, secrets={},
                              log=logs[-1], labels=labels))
    return pods, logs


def run_pods(tmp: Path, runtime: dict, trainjob: dict, attempt: int, *, stop_after: int = 0):
    """Start every pod of JobSet restart ``attempt``; with ``stop_after``, SIGTERM pod 1's main
    process once that many steps are logged. Returns the exit codes and the logs."""
    pods, logs = start_pods(tmp, runtime, trainjob, attempt)
    metrics = tmp / "runs" / "outputs" / "k8s" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while stop_after and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= stop_after:
            os.kill(pods[1].pid, signal.SIGTERM)  # the kubelet signals the container's PID 1
            break
        if any(p.poll() is not None for p in pods):
            break
        time.sleep(0.05)
    codes = []
    for pod in pods:
        try:
            codes.append(pod.wait(timeout=240))
        except subprocess.TimeoutExpired:
            os.killpg(pod.pid, signal.SIGKILL)
            codes.append(None)
    return codes, "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)


def test_rendered_pods_train_stop_on_sigterm_with_75_and_resume_bitwise(tmp_path):
    runtime, trainjob = render(*TINY, *RUN, "cluster=k8s_cpu", "cluster.nodes=2", "run.name=k8s")
    assert [runtime["kind"], trainjob["kind"]] == ["TrainingRuntime", "TrainJob"]
    assert trainjob["spec"]["trainer"] == {"numNodes": 2, "numProcPerNode": 1}

    codes, logs = run_pods(tmp_path, runtime, trainjob, 0, stop_after=3)
    assert codes == [REQUEUE_EXIT, REQUEUE_EXIT], logs
    run_dir = tmp_path / "runs" / "outputs" / "k8s"
    saved = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(saved.split("_")[1])
    assert 3 <= stopped_at < STEPS and max(steps_of(run_dir)) == stopped_at

    codes, logs = run_pods(tmp_path, runtime, trainjob, 1)
    assert codes == [0, 0], logs
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["nodes"] == 2
    resumed = {s: row["loss"] for s, row in steps_of(run_dir).items()}
    assert sorted(resumed) == list(range(1, STEPS + 1))

    train(tmp_path, "straight", *RUN, "cluster.gpus_per_node=2")
    straight = {s: row["loss"] for s, row in steps_of(tmp_path / "straight").items()}
    assert resumed == straight


@pytest.mark.parametrize("delay", [1.0, 4.0])
def test_pods_sigtermed_during_start_up_exit_75_within_seconds(tmp_path, delay):
    """The kubelet's SIGTERM to each pod's main process (a preemption, a drain, the JobSet
    restarting the job) ``delay`` s after the pods start: 1 s, while the agent's exec'd
    launcher composes; 4 s, while the ranks start. Each pod exits 75 within 5 s with one line and
    no step (issue 44; before the fix 143 at 1 s)."""
    runtime, trainjob = render(*TINY, *RUN, "cluster=k8s_cpu", "cluster.nodes=2", "run.name=k8s")
    pods, logs = start_pods(tmp_path, runtime, trainjob, 0)
    time.sleep(delay)
    codes, took = [], []
    try:
        for pod in reversed(pods):  # pod 1 first, then the JobSet ends pod 0
            sent = time.monotonic()
            os.kill(pod.pid, signal.SIGTERM)
            codes.append(pod.wait(timeout=30))
            took.append(time.monotonic() - sent)
    finally:
        for pod in pods:
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGKILL)
    text = "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)
    assert codes == [REQUEUE_EXIT, REQUEUE_EXIT] and max(took) < 5.0, (codes, took, text)
    for log in logs:
        lines = [l for l in log.read_text().splitlines() if "stopped by SIGTERM" in l]
        assert len(lines) == 1 and "during start-up" in lines[0], text
    assert "Traceback" not in text and "restarting every rank" not in text, text
    run_dir = tmp_path / "runs" / "outputs" / "k8s"
    assert not (run_dir / "metrics.jsonl").exists() or not steps_of(run_dir)
