"""``launch.mode=torchrun`` on loopback: two elastic agents (``python -m launcher.launch.agent
--nnodes=2``, as the job script starts one per node) rendezvous over c10d and their two processes
(2 "nodes" x 1) train as one world."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.parallel.distributed import free_port
from tests.helpers.training import REPO, TINY, steps_of


@pytest.mark.slow
def test_two_agents_on_loopback_form_one_world_and_train(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    overrides = [*TINY, "cluster=local_cpu", "cluster.nodes=2", "cluster.gpus_per_node=1",
                 "trainer.train_steps=6", "trainer.eval_interval=0", "trainer.save_interval=0",
                 f"run.output_root={tmp_path}", "run.name=two_nodes"]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "launcher.launch.agent", "--nnodes=2", "--nproc-per-node=1",
         f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=tw-{port}", "--local-addr=127.0.0.1",
         "--", *overrides], cwd=tmp_path, env=env, stdout=open(tmp_path / f"agent{n}.log", "w"),
        stderr=subprocess.STDOUT) for n in range(2)]
    codes = [agent.wait(timeout=240) for agent in agents]
    logs = "".join((tmp_path / f"agent{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], logs
    run_dir = tmp_path / "two_nodes"
    assert sorted(steps_of(run_dir)) == list(range(1, 7))
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["data_parallel_size"] == 2
    env_json = json.loads((run_dir / "env.json").read_text())
    assert "TORCHELASTIC_RUN_ID" in json.dumps(env_json)
