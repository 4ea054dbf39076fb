"""distributed.py: Slurm hostlists and env mapping; elastic local launch (gloo all_reduce, exit code
propagation of REQUEUE_EXIT from one worker).

The launch tests run this file as a script (``__main__`` guard below), so the spawned workers
re-import it safely and the launcher's own process exit code is what the test checks.
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

from launcher.parallel.distributed import (LAUNCHED_LOCAL_RANK_ENV, _tasks_on_node,
                                           expand_hostlist, in_distributed_launch, shared_gpu_env,
                                           torch_env_from_slurm)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("a[1-2]-b[01-02]", ["a1-b01", "a1-b02", "a2-b01", "a2-b02"]),
    ("x[009-011]y,z", ["x009y", "x010y", "x011y", "z"]),
    ("h1,h2, h3", ["h1", "h2", "h3"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]1[", "n[a-b]", "n[3-1]", "", "n[[1]]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_tasks_per_node_syntax():
    assert [_tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    assert _tasks_on_node("8", 5) == 8


SLURM = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "2",
         "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "gpu[07-10]",
         "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"}


def test_torch_env_from_slurm():
    assert torch_env_from_slurm(SLURM) == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 123456 % 20000)}


@pytest.mark.parametrize("rank, local_rank, per_gpu, gpu", [(1, 1, 2, "0"), (5, 3, 2, "1"),
                                                             (7, 7, 8, "0"), (2, 2, 4, "0")])
def test_ranks_sharing_a_gpu_name_it_as_their_local_rank(rank, local_rank, per_gpu, gpu):
    """DeepSpeed's ZeRO-3 takes LOCAL_RANK for a CUDA ordinal: at local rank 1 of 2 ranks on one
    GPU it asked for cuda:1 ("invalid device ordinal", seen on an H100); the launcher's own local
    rank is kept beside it, and each rank still has its own NCCL host id."""
    env = shared_gpu_env(rank, local_rank, per_gpu, "node7")
    assert env["LOCAL_RANK"] == gpu and env[LAUNCHED_LOCAL_RANK_ENV] == str(local_rank)
    assert env["NCCL_HOSTID"] == f"node7-rank{rank}"


def test_torch_env_from_slurm_keeps_explicit_master_and_ntasks_per_node():
    env = dict(SLURM, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", SLURM_NTASKS_PER_NODE="4")
    out = torch_env_from_slurm(env)
    assert (out["MASTER_ADDR"], out["MASTER_PORT"], out["LOCAL_WORLD_SIZE"]) == \
        ("10.0.0.1", "29500", "4")
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        torch_env_from_slurm({"SLURM_NTASKS": "2"})


def test_in_distributed_launch():
    assert in_distributed_launch({"RANK": "0", "WORLD_SIZE": "1"})
    assert in_distributed_launch(SLURM)
    assert not in_distributed_launch({})
    assert not in_distributed_launch(dict(SLURM, SLURM_NTASKS="1"))
    batch_script = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert not in_distributed_launch(batch_script)  # sbatch script itself, not an srun task


def _launch(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, __file__, mode, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


@pytest.mark.slow
def test_launch_local_world_forms_gloo_group(tmp_path):
    proc = _launch(tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["backend"] == "gloo" for r in results)


@pytest.mark.slow
def test_launch_local_world_propagates_requeue_exit_code(tmp_path):
    proc = _launch(tmp_path, "requeue")
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "rank 1 failed with exit code 75" in proc.stderr
    assert (tmp_path / "rank1.json").exists()  # it got past the all_reduce before exiting
    assert list((tmp_path / "logs").rglob("*.log")), "worker logs not written under log_dir"


@pytest.mark.slow
def test_stop_signal_to_process_group_requeues(tmp_path):
    """As under Slurm: SIGUSR1 reaches the launcher and every worker; the launcher survives,
    the workers agree to stop and exit 75, and the launcher exits 75."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, __file__, "signal", str(tmp_path)], env=env,
                            cwd=REPO_ROOT, start_new_session=True, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, "workers never got ready"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    assert sorted(p.name for p in tmp_path.glob("stopped*")) == ["stopped0", "stopped1"]


def _wait_for_stop(out_dir: str, rank: int) -> None:
    """Steps until every rank agrees to stop (after a SIGUSR1 to the process group)."""
    from launcher.core.exits import REQUEUE_EXIT
    from launcher.core.stop import StopRequest
    from launcher.parallel import collectives

    stop = StopRequest("SIGUSR1", any_rank=collectives.any_rank)
    Path(out_dir, f"ready{rank}").touch()
    for _ in range(2000):
        time.sleep(0.02)
        if stop.agree():
            Path(out_dir, f"stopped{rank}").touch()
            raise SystemExit(REQUEUE_EXIT)
    raise RuntimeError("no stop signal arrived")


def worker(mode: str, out_dir: str) -> None:
    """Join the group through init_distributed, all_reduce rank+1, record, maybe exit 75."""
    import torch
    import torch.distributed as dist

    from launcher.parallel.distributed import destroy_distributed, init_distributed
    from launcher.core.exits import REQUEUE_EXIT

    rank, local_rank, world = init_distributed(timeout_s=60)
    # A rank leaves its group before it exits, as the training entry point does: one that exits
    # with its gloo group alive can abort in the group's destructor at interpreter exit under load
    # ("terminate called without an active exception", SIGABRT), which replaces its exit code.
    try:
        if mode == "signal":
            _wait_for_stop(out_dir, rank)
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        result = {"rank": rank, "local_rank": local_rank, "world": world, "sum": value.item(),
                  "backend": dist.get_backend()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        if mode == "requeue" and rank == 1:
            raise SystemExit(REQUEUE_EXIT)
        if mode == "requeue":
            time.sleep(60)  # the agent stops rank 0 (SIGTERM) once rank 1 has failed
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    from launcher.launch.local import launch_local_world

    mode_arg, out = sys.argv[1], sys.argv[2]
    log_dir = Path(out, "logs") if mode_arg == "requeue" else None
    launch_local_world(worker, (mode_arg, out), nprocs=2, run_id=f"test_{mode_arg}",
                       log_dir=log_dir)


INIT_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
if __name__ == "__main__":
    import torch, torch.distributed as dist
    from launcher.parallel.distributed import init_distributed, destroy_distributed
    rank, local_rank, world = init_distributed(timeout_s=60)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(json.dumps([rank, local_rank, world, value.item(), dist.get_backend()]))
    destroy_distributed()
"""


def _slurm_task(procid: int, ntasks: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_PROCID=str(procid), SLURM_LOCALID=str(procid), SLURM_NTASKS=str(ntasks),
               SLURM_TASKS_PER_NODE=str(ntasks), SLURM_JOB_NODELIST="127.0.0.[1]",
               SLURM_STEP_ID="0", SLURM_JOB_ID="1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow
def test_init_distributed_under_srun_variables_and_alone():
    from tests.helpers.dist import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", INIT_SCRIPT, str(REPO_ROOT)],
                              env=_slurm_task(r, 2, port), stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [json.loads(o) for o in outs] == [[0, 0, 2, 3.0, "gloo"], [1, 1, 2, 3.0, "gloo"]]
    alone = {k: v for k, v in _slurm_task(0, 1, port).items() if not k.startswith("SLURM")}
    out = subprocess.run([sys.executable, "-c", INIT_SCRIPT, str(REPO_ROOT)], env=alone,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == [0, 0, 1, 1.0, "gloo"]
