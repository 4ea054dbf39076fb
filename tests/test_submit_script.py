"""``launcher.submit`` without a cluster: the rendered script (dry run) has the plan's layout, is
valid bash, quotes every override, rejects newlines in ``#SBATCH`` values and never holds secrets.
The scripts really running under Slurm are tested in tests/test_slurm_jobs.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.submit import HOSTILE, hydra_quote

REPO = Path(__file__).resolve().parent.parent


def submit(tmp: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "launcher.submit", f"run.output_root={tmp}",
                           "submit.dry_run=true", *overrides], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=120)


def bash_n(script: str, tmp: Path) -> None:
    path = tmp / "check.sbatch"
    path.write_text(script)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_16k_gpu_recipe_dry_run_in_srun_mode_has_2048_nodes_of_8_tasks(tmp_path):
    proc = submit(tmp_path, "experiment=llama3_70b_16k_h100", "launch.mode=srun")
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    assert "#SBATCH --nodes=2048\n" in script and "#SBATCH --ntasks-per-node=8\n" in script
    assert "#SBATCH --gpus-per-node=8\n" in script and "#SBATCH --signal=USR1@300\n" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--nodes=2048" in srun and "--ntasks-per-node=8" in srun
    assert srun.endswith(f"-m launcher.train run.output_root={tmp_path} submit.dry_run=true "
                         f"experiment=llama3_70b_16k_h100 launch.mode=srun")
    assert f"#SBATCH --output={tmp_path}/llama3_70b_16k_h100/logs/slurm-%j.out" in script
    bash_n(script, tmp_path)
    assert not (tmp_path / "llama3_70b_16k_h100").exists()  # a dry run writes nothing


def test_node_and_gpu_counts_come_from_the_cluster_and_plan(tmp_path):
    proc = submit(tmp_path, "experiment=llama3_8b_1x8_h100", "cluster.nodes=4",
                  "cluster.partition=gpu", "cluster.account=proj", "cluster.qos=high",
                  "cluster.constraint='h100&ib'", "cluster.mem=500G", "cluster.time_limit=1-00:00:00")
    assert proc.returncode == 0, proc.stderr
    # the default launch.mode=torchrun: one agent per node with the node's CPUs (16 per GPU)
    for line in ("--nodes=4", "--ntasks-per-node=1", "--partition=gpu", "--account=proj",
                 "--qos=high", "--constraint=h100&ib", "--mem=500G", "--time=1-00:00:00",
                 "--exclusive", "--requeue", "--cpus-per-task=128", "--gpus-per-node=8"):
        assert re.search(rf"^#SBATCH {re.escape(line)}$", proc.stdout, re.M), line


def test_by_default_one_agent_per_node_starts_with_rendezvous_on_the_first(tmp_path):
    """launch.mode=torchrun is the default: the agents watch their ranks (hangs, restarts)."""
    proc = submit(tmp_path, "experiment=mixtral_8x7b_8x8_h100",
                  "cluster.container_image='nvcr.io#nvidia/pytorch:24.05-py3'",
                  "cluster.container_mounts=/data:/data")
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    assert "#SBATCH --nodes=8\n" in script and "#SBATCH --ntasks-per-node=1\n" in script
    assert "#SBATCH --cpus-per-task=128\n" in script
    assert 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    for part in ("--ntasks-per-node=1", "-m launcher.launch.agent", "--nnodes=8", "--nproc-per-node=8",
                 '--rdzv-endpoint="$HEAD:29500"', "'--container-image=nvcr.io#nvidia/pytorch:"
                 "24.05-py3'", "--container-mounts=/data:/data"):
        assert part in srun, part
    bash_n(script, tmp_path)


def test_hostile_override_values_are_quoted_and_never_executed(tmp_path):
    overrides = [f"data.tokenizer_path={hydra_quote(HOSTILE)}",
                 f"logger.tags=[{hydra_quote(HOSTILE)},plain]"]
    proc = submit(tmp_path, "cluster=slurm_cpu", *overrides)
    assert proc.returncode == 0, proc.stderr
    bash_n(proc.stdout, tmp_path)
    srun = next(line for line in proc.stdout.splitlines() if line.startswith("srun "))
    # bash itself parses the srun line back into exactly the overrides given (after the
    # agent's "--")
    words = subprocess.run(["bash", "-c", 'printf "%s\\0" ' + srun.split(" -- ", 1)[1]],
                           capture_output=True, text=True, cwd=tmp_path).stdout.split("\0")[:-1]
    assert words == [f"run.output_root={tmp_path}", "submit.dry_run=true", "cluster=slurm_cpu",
                     *overrides]
    assert not list(tmp_path.glob("PWNED*"))


@pytest.mark.parametrize("override", ["cluster.account='proj\nx'", "run.name='a\nb'",
                                      "cluster.partition='gpu\r--qos=high'"])
def test_newline_in_an_sbatch_value_is_rejected_with_exit_2(tmp_path, override):
    proc = submit(tmp_path, "cluster=slurm_cpu", override)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "newline" in proc.stderr and proc.stdout == ""


def test_plan_problems_and_local_clusters_fail_before_anything_is_written(tmp_path):
    proc = submit(tmp_path, "cluster=slurm_cpu", "trainer.global_batch_size=7",
                  "trainer.train_steps=10")
    assert proc.returncode == 2 and "global_batch_size=7" in proc.stderr and proc.stdout == ""
    proc = submit(tmp_path, "cluster=local_cpu")
    assert proc.returncode == 2 and "launcher=local" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_secrets_from_the_environment_never_reach_the_script(tmp_path):
    secret = "wandb-secret-0123456789abcdef"
    proc = submit(tmp_path, "cluster=slurm_cpu", "logger=wandb",
                  env={"WANDB_API_KEY": secret, "HF_TOKEN": secret + "x"})
    assert proc.returncode == 0, proc.stderr
    assert secret not in proc.stdout
