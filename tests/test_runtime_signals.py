"""launcher.core.stop: a signal sets only a flag; agree() makes every rank stop at the same step."""

from __future__ import annotations

import os
import signal

import pytest

from launcher.core.exits import REQUEUE_EXIT
from launcher.core.stop import StopRequest, forward_stop_signals, restore_handlers
from tests.helpers.dist import run_distributed


def stop_worker(args: dict) -> dict:
    """Run steps; rank 1 signals itself at ``args['signal_step']``; record when agree() fires."""
    import torch.distributed as dist

    from launcher.parallel import collectives

    stop = StopRequest("SIGUSR1", any_rank=collectives.any_rank)

    rank, stopped_at, local_at_stop = dist.get_rank(), None, None
    try:
        for step in range(args["steps"]):
            if rank == 1 and step == args["signal_step"]:
                os.kill(os.getpid(), signal.SIGUSR1)
            if stop.agree():
                stopped_at, local_at_stop = step, stop.requested
                break
    finally:
        stop.restore()
    return {"stopped_at": stopped_at, "requested": local_at_stop}


@pytest.mark.slow
def test_all_ranks_agree_at_same_step_when_one_rank_is_signalled():
    results = run_distributed("tests.test_runtime_signals:stop_worker", 2,
                              {"steps": 20, "signal_step": 3}, timeout=90)
    assert [r["stopped_at"] for r in results] == [3, 3]
    assert [r["requested"] for r in results] == [False, True]  # only rank 1 got the signal


def test_sigterm_sets_flag_instead_of_killing_and_restore():
    before_term = signal.getsignal(signal.SIGTERM)
    before_usr2 = signal.getsignal(signal.SIGUSR2)
    stop = StopRequest("USR2")
    try:
        assert not stop.requested and not stop.agree()  # no process group: local flag
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.agree()
        assert stop.signal_received == signal.SIGTERM
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before_term
    assert signal.getsignal(signal.SIGUSR2) == before_usr2


def test_configured_signal_and_bad_name():
    stop = StopRequest("SIGUSR2")
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested
    finally:
        stop.restore()
    with pytest.raises(ValueError, match="trainer.stop_signal='SIGNOPE'"):
        StopRequest("SIGNOPE")
    assert REQUEUE_EXIT == 75


def test_the_forwarding_handler_never_raises_and_imports_nothing(capsys):
    """A launcher gets a stop signal twice under Slurm (from Slurm and from its parent); the
    handler must survive a second run in the middle of the first and any failure to list ranks."""
    import subprocess
    import sys

    code = ("import sys, launcher.core.stop; "
            "print('psutil' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip() == "True"  # nothing left for a handler to import

    def broken():
        raise AttributeError("partially initialized module")

    previous = forward_stop_signals("SIGUSR1", broken)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # handled: no exception reaches this frame
    finally:
        restore_handlers(previous)
    assert "could not forward signal" in capsys.readouterr().err
