"""``python -m launcher.convert reshard``: engine=megatron saves the distributed optimizer in the
fast per-rank format by default (dp_reshardable); a resume at another TP is refused with the
conversion command in the message; the conversion (1 rank: the saved TP=1 layout at the
smallest DP) writes a copy that resumes at TP=2 within float noise of the straight run, and at
the saved layout bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.training import REPO, train

# its module-scoped runs are made once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("reshard_convert")

MEGATRON = ["engine=megatron", "parallelism.zero_stage=1", "trainer.global_batch_size=8",
            "trainer.save_interval=2", "trainer.keep_last=0", "trainer.eval_interval=0",
            "trainer.train_steps=4"]


def convert(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "launcher.convert", "reshard", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def rows(run_dir: Path) -> list:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r]


def sharding(step_dir: Path) -> str:
    from megatron.core import dist_checkpointing

    from launcher.engines import compat

    with compat.checkpoint_loads_without_code():
        saved = dist_checkpointing.load_content_metadata(str(step_dir / "megatron"))
    return saved["distrib_optim_sharding_type"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A straight 4-step DP=2 run (saves at 2 and 4), its step 2 refused at TP=2, converted,
    then resumed at TP=2 and at the saved layout."""
    tmp = tmp_path_factory.mktemp("reshard")
    train(tmp, "straight", *MEGATRON)
    step2 = tmp / "straight" / "checkpoints" / "step_000002"
    refused = train(tmp, "refused", *MEGATRON, "parallelism.tensor_parallel_size=2",
                    f"trainer.load={step2}", expect=2)
    conversion = convert(f"checkpoint={step2}", f"out={tmp / 'conv'}")
    train(tmp, "tp2", *MEGATRON, "parallelism.tensor_parallel_size=2",
          f"trainer.load={tmp / 'conv'}")
    train(tmp, "same", *MEGATRON, f"trainer.load={tmp / 'conv'}")
    return {"tmp": tmp, "step2": step2, "refused": refused.stdout + refused.stderr,
            "conversion": conversion.stderr}


@pytest.mark.slow
def test_the_default_format_is_dp_reshardable_and_a_tp_change_names_the_conversion(converted):
    step2 = converted["step2"]
    assert sharding(step2) == "dp_reshardable"
    message = converted["refused"]
    assert f"python -m launcher.convert reshard checkpoint={step2} out=<new dir>" in message, \
        message[-3000:]
    assert "then resume with trainer.load=<new dir>" in message


@pytest.mark.slow
def test_conversion_writes_the_same_step_in_the_model_space_format(converted):
    tmp, step2 = converted["tmp"], converted["step2"]
    conv = tmp / "conv" / "checkpoints"
    assert (conv / "latest").read_text().strip() == "step_000002"
    assert sharding(conv / "step_000002") == "fully_reshardable"
    assert not (tmp / "conv.partial").exists()
    # the saved run's metadata (config, plan, records) and every rank's RNG file, unchanged
    original = json.loads((step2 / "trainwright.json").read_text())
    assert json.loads((conv / "step_000002" / "trainwright.json").read_text()) == original
    for rng in sorted((step2 / "rng").iterdir()):
        assert (conv / "step_000002" / "rng" / rng.name).read_bytes() == rng.read_bytes()
    assert sorted(p.name for p in (conv / "step_000002" / "rng").iterdir()) == \
        ["rank_0.pt", "rank_1.pt"]
    assert f"resume at any layout with trainer.load={tmp / 'conv'}" in converted["conversion"]


@pytest.mark.slow
def test_converted_checkpoint_resumes_at_tp2_and_bitwise_at_the_saved_layout(converted):
    tmp = converted["tmp"]
    straight = rows(tmp / "straight")[2:]
    assert [r[0] for r in straight] == [3, 4]
    assert rows(tmp / "same") == straight  # bit for bit through the conversion
    tp2 = rows(tmp / "tp2")
    assert [r[0] for r in tp2] == [3, 4]
    for mine, theirs in zip(tp2, straight, strict=True):
        assert mine[1] == pytest.approx(theirs[1], abs=1e-5), (tp2, straight)
    plan = json.loads((tmp / "tp2" / "plan.json").read_text())
    assert plan["tensor_parallel_size"] == 2


@pytest.mark.slow
def test_converting_a_converted_checkpoint_is_a_no_op(converted):
    tmp = converted["tmp"]
    proc = convert(f"checkpoint={tmp / 'conv'}", f"out={tmp / 'again'}")
    assert "nothing to convert" in proc.stderr and "already loads at any layout" in proc.stderr
    assert not (tmp / "again").exists()


def test_refusals_exit_2_naming_the_problem(tmp_path):
    """Not a Megatron checkpoint, an out= that is not empty, a setting that is not cluster.*."""
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    (step / "rng").mkdir(parents=True)
    (step / "trainwright.json").write_text(json.dumps({"step": 2, "consumed_samples": 16}))
    (step / "complete").write_text("2\n")
    proc = convert(f"checkpoint={step}", f"out={tmp_path / 'out'}", expect=2)
    assert "not an engine=megatron checkpoint" in proc.stderr
    assert f"trainer.init_from={step}" in proc.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    proc = convert(f"checkpoint={step}", f"out={tmp_path / 'full'}", expect=2)
    assert "exists and is not empty" in proc.stderr
    proc = convert(f"checkpoint={step}", f"out={tmp_path / 'o'}",
                   "parallelism.tensor_parallel_size=2", expect=2)
    assert "unknown argument 'parallelism.tensor_parallel_size=2'" in proc.stderr
    assert "cluster.* overrides" in proc.stderr
