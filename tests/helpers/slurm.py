"""The one-node Slurm cluster of the Slurm tests, and helpers to submit jobs and wait for them.

The ``slurm`` fixture is defined here and offered to every test module by tests/conftest.py (a
test asks for it by name). It starts the cluster with ``.ci/slurm_up.sh`` (once per test process,
under a file lock); the tests are skipped only when the Slurm packages are missing and cannot be
installed (not root, apt failing).

The node has as many CPUs as the machine and every test job asks for all of them, so two tests
submitting at once would wait on each other's jobs inside their own time limits. The fixture
therefore also holds an exclusive lock for the whole test: Slurm tests run one at a time across
pytest-xdist workers, whichever way the workers are scheduled.

``submit`` runs ``launcher.submit experiment=tiny_1x2_cpu`` on a small model (``SMALL``) and
returns the job id (formerly in tests/test_slurm_jobs.py; tests/test_eval_jobs.py submits too).

Formerly tests/_slurm.py.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.processes import unmarked_env

REPO = Path(__file__).resolve().parents[2]
LOCK = Path("/tmp/trainwright_slurm_up.lock")
JOBS_LOCK = Path("/tmp/trainwright_slurm_jobs.lock")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
         "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=512",
         "model.seq_length=64"]
"""The model of the Slurm test jobs: small enough for a CPU job of a few seconds."""
_TOOLS = ("sbatch", "srun", "scontrol", "squeue", "slurmctld", "slurmd", "munged")


def _have_packages() -> bool:
    return all(shutil.which(t) or Path(f"/usr/sbin/{t}").exists() for t in _TOOLS)


@functools.cache
def _start_cluster() -> str:
    """Run ``.ci/slurm_up.sh`` once per process; '' when Slurm runs, else why it does not."""
    had_packages = _have_packages()
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(["bash", str(REPO / ".ci" / "slurm_up.sh")], capture_output=True,
                              text=True, timeout=900, env=unmarked_env())  # daemons outlive it
    if proc.returncode == 0:
        return ""
    reason = f".ci/slurm_up.sh exited {proc.returncode}: {proc.stderr.strip()[-800:]}"
    if not had_packages and not _have_packages():
        return f"skip: Slurm packages cannot be installed here ({reason})"
    return f"fail: Slurm is installed but did not start: {reason}"


@pytest.fixture
def slurm():
    """A running one-node Slurm (partition debug), held by this test alone until it ends."""
    problem = _start_cluster()
    if problem.startswith("skip: "):
        pytest.skip(problem.removeprefix("skip: "))
    if problem:
        pytest.fail(problem.removeprefix("fail: "))
    with open(JOBS_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield True


def job_env(**extra: str) -> dict:
    """Environment of a test job (inherited by Slurm): fast CPU settings, no wandb network."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
            "PYTHONPATH": str(REPO), "TRAINWRIGHT_PYTHON": sys.executable, **extra}


def sbatch(*args: str, env: dict, cwd: Path = REPO) -> str:
    """``sbatch --parsable args``; returns the job id."""
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def submit(tmp: Path, *overrides: str, env: dict) -> str:
    """``python -m launcher.submit experiment=tiny_1x2_cpu`` (``SMALL``, run.output_root=tmp,
    then ``overrides``) from ``tmp``; returns the job id."""
    proc = subprocess.run([sys.executable, "-m", "launcher.submit", "experiment=tiny_1x2_cpu",
                           f"run.output_root={tmp}", *SMALL, *overrides], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def job_info(job_id: str) -> dict:
    """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, ...)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True, timeout=30).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_job(job_id: str, timeout: float = 300, logs: Path | None = None) -> dict:
    """Wait until the job is in a terminal state; cancel it and fail on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in TERMINAL:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], timeout=30)
    text = "".join(p.read_text()[-3000:] for p in sorted(logs.glob("slurm-*"))) if logs else ""
    pytest.fail(f"job {job_id} did not finish in {timeout}s: {job_info(job_id)}\n"
                f"queue:\n{queue()}\n{text}")


def queue() -> str:
    """Every job Slurm knows (``squeue``): id, name, state, reason, time used."""
    return subprocess.run(["squeue", "-h", "-o", "%i %j %T %r %M"], capture_output=True,
                          text=True, timeout=30).stdout


def start_requeued_job_now(job: str) -> None:
    """Slurm holds a requeued job for 121 s (EligibleTime); let it start now, safely.

    The node revokes the old allocation's credential when its batch script ends and refuses any
    credential issued in that same second ("Job credential revoked"), so wait until the job is
    back in the queue and one more second has passed.
    """
    deadline = time.monotonic() + 60
    while job_info(job).get("JobState") != "PENDING" and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30)


def read_logs(logs: Path) -> str:
    """All Slurm output and error files of a run's logs directory."""
    return "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(logs.glob("slurm-*")))
