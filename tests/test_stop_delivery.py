"""Stop signals as schedulers and terminals deliver them, to a 2-rank ``python -m launcher.train``
with DataLoader worker processes on (``data.num_workers=2``).

Slurm (``proctrack/cgroup``, time limits), Kubernetes and a terminal's Ctrl-C signal the whole
process group, loader workers included; ``scancel --signal``/``kill <pid>`` reach the launcher
only. Every delivery must end the same way: every rank saves the same step, the loader workers
do not die of the signal, and the job exits 75 ("saved, requeue me"). (Delivery to one rank is
``tests/test_train_signal.py``.) The deliveries run engine=deepspeed (the default), and SIGTERM to
the group also engine=megatron, whose checkpoint writes go through helper processes.

Before the fix: USR1 to the group killed the loader workers (exit 1, no checkpoint), TERM to the
group exited 143 with no checkpoint, USR1 to the launcher was ignored (the run went on to its
end), TERM to the launcher saved but exited 143, and INT to the group exited 130 without a
checkpoint.
"""

from __future__ import annotations

import os
import signal

import pytest

from launcher.core.exits import REQUEUE_EXIT
from tests.helpers.signals import STEPS, launch, logged_steps, wait_for
from tests.helpers.training import steps_of

MEGATRON_SAVED_BEFORE = ("engine=megatron", "parallelism.zero_stage=1",
                         "trainer.save_interval=2", "trainer.keep_last=1")
"""engine=megatron saves through Megatron-Core's writer processes and its save-results queue,
a server process in the same group that a first save (here step 2's) has started: before its
fix, SIGTERM to the group killed that server and the save the signal asked for failed
(ConnectionRefusedError, exit 1). keep_last=1: only the stop's checkpoint is left."""
DELIVERIES = {  # signal, to whom, overrides, steps logged before the signal
    "usr1_to_group": (signal.SIGUSR1, "group", (), 2),
    "term_to_group": (signal.SIGTERM, "group", (), 2),
    "int_to_group": (signal.SIGINT, "group", (), 2),
    "usr1_to_launcher": (signal.SIGUSR1, "launcher", (), 2),
    "term_to_launcher": (signal.SIGTERM, "launcher", (), 2),
    "term_to_group_megatron_after_a_save": (signal.SIGTERM, "group", MEGATRON_SAVED_BEFORE, 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DELIVERIES))
def test_stop_signal_saves_one_step_on_every_rank_and_exits_75(tmp_path, name):
    sig, target, overrides, ready = DELIVERIES[name]
    run_dir, log = tmp_path / name, tmp_path / f"{name}.log"
    proc = launch(tmp_path, name, log, "data.num_workers=2", *overrides)
    wait_for(proc, log, lambda: logged_steps(run_dir) >= ready)
    if target == "group":
        os.killpg(proc.pid, sig)  # the launcher leads its own session: pgid == its pid
    else:
        os.kill(proc.pid, sig)
    code = proc.wait(timeout=150)
    # the console, and each rank's log (library output, loader workers' deaths, go there)
    output = log.read_text() + "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert code == REQUEUE_EXIT, output[-4000:]
    assert "DataLoader worker" not in output, output[-4000:]
    ckpts = run_dir / "checkpoints"
    saved = (ckpts / "latest").read_text().strip()
    step = int(saved.split("_")[1])
    assert 2 <= step < STEPS and max(steps_of(run_dir)) == step
    assert sorted(p.name for p in ckpts.glob("step_*")) == [saved]
    files = {p.relative_to(ckpts / saved).as_posix() for p in (ckpts / saved).rglob("*")}
    assert {"complete", "rng/rank_0.pt", "rng/rank_1.pt"} <= files
