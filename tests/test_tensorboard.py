"""logger.tensorboard: a real 2-rank run with ``logger=[wandb,tensorboard]`` (wandb offline)
writes TensorBoard event files under <run_dir>/tensorboard/, read back with TensorBoard's own
reader: every key of every step line of metrics.jsonl, the same values (as float32, the event
format's precision), the goodput at the last step; wandb's offline run is written beside it. A
resume from an earlier checkpoint recomputes steps 4-6 into the same directory, and TensorBoard
shows each step once, with the values of the later attempt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.training import train

# its module-scoped runs are made once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("tensorboard")

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
RUN = ["logger=[wandb,tensorboard]", "trainer.train_steps=6", "trainer.save_interval=3",
       "trainer.eval_interval=3", "trainer.global_batch_size=8"]


def scalars(run_dir: Path) -> dict:
    """tag -> {step: value} from TensorBoard's EventAccumulator (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        out[tag] = {e.step: e.value for e in events}
        assert len(out[tag]) == len(events), f"{tag}: a step logged twice"
    return out


def last_lines(run_dir: Path) -> dict:
    """step -> the last metrics.jsonl line of that step (training and evaluation merged)."""
    out: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row or "eval/loss" in row:
            out.setdefault(row["step"], {}).update({k: v for k, v in row.items()
                                                    if k not in ("time", "step")})
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tb")
    train(tmp, "tb", *RUN, env=OFFLINE)
    run_dir = tmp / "tb"
    first = (scalars(run_dir), last_lines(run_dir))
    # A later attempt resumes from step 3 (as after a failure at step 6): steps 4-6 again.
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / "step_000006")
    (checkpoints / "latest").unlink()
    (checkpoints / "latest").write_text("step_000003\n")
    train(tmp, "tb", *RUN, env=OFFLINE)
    return run_dir, first


@pytest.mark.slow
def test_every_step_key_is_in_tensorboard_with_its_value(run):
    run_dir, (first, lines) = run
    assert sorted(lines) == [1, 2, 3, 4, 5, 6]
    for step, row in lines.items():
        for key, value in row.items():
            if value is not None:
                assert first[key][step] == pytest.approx(np.float32(value), rel=1e-6), \
                    (key, step)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "time/forward", "eval/loss"} <= set(first)
    assert "goodput" in first and 0 < first["goodput"][6] <= 1
    assert list((run_dir / "wandb").glob("offline-run-*"))  # wandb too, in the same run


@pytest.mark.slow
def test_a_resumed_run_appends_and_each_step_shows_once(run):
    run_dir, _ = run
    events = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 2  # one file per start, one directory
    after = scalars(run_dir)  # raises if a step shows twice
    lines = last_lines(run_dir)
    assert sorted(after["loss"]) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert after["loss"][step] == pytest.approx(np.float32(lines[step]["loss"]), rel=1e-6)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
