"""Quiet by default: the console gets step lines, events and errors; library output (warnings,
banners, wandb) goes to logs/rank_<r>.log; run.verbose=true puts it back on the console."""

from __future__ import annotations

import pytest

from tests.helpers.training import train

pytestmark = pytest.mark.slow

CHATTER = "Apex is not installed"  # Megatron-Core's import-time warning on a machine without Apex


def test_library_output_goes_to_rank_logs_and_errors_stay_on_the_console(tmp_path):
    proc = train(tmp_path, "quiet", "trainer.train_steps=3", "trainer.eval_interval=0")
    console = proc.stdout + proc.stderr
    assert [l.split("|")[0].strip() for l in proc.stdout.splitlines() if l.startswith("step ")] \
        == ["step 1", "step 2", "step 3"]
    assert CHATTER not in console and "Warning" not in console, console[-3000:]
    logs = tmp_path / "quiet" / "logs"
    assert f"[logs] library output of each rank: {logs}/rank_<r>.log" in proc.stdout
    for rank in (0, 1):
        assert CHATTER in (logs / f"rank_{rank}.log").read_text()
    # an error of the run itself is on the console (and in the rank log)
    failed = train(tmp_path, "quiet", f"trainer.load={tmp_path}/nowhere", expect=1)
    assert f"{tmp_path}/nowhere" in failed.stderr
    assert f"{tmp_path}/nowhere" in (logs / "rank_0.log").read_text()


def test_run_verbose_shows_library_output_on_the_console(tmp_path):
    proc = train(tmp_path, "loud", "trainer.train_steps=1", "trainer.eval_interval=0",
                 "run.verbose=true")
    assert CHATTER in proc.stdout + proc.stderr
    assert not list((tmp_path / "loud" / "logs").glob("*.log"))
