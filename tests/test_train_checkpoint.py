"""Which checkpoint a run resumes from, and the clear errors when the asked-for one is unusable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.core.atomic import atomic_symlink_or_pointer
from launcher.core.checkpoints import complete_steps, find_resume, prune, step_name
from launcher.core.errors import CheckpointError


def make_step(ckpts: Path, step: int, complete: bool = True) -> Path:
    path = ckpts / step_name(step)
    path.mkdir(parents=True)
    (path / "trainwright.json").write_text(json.dumps({"step": step, "consumed_samples": 8 * step}))
    if complete:
        (path / "complete").write_text(f"{step}\n")
    return path


def test_fresh_run_has_nothing_to_resume(tmp_path):
    assert find_resume(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    make_step(tmp_path / "checkpoints", 5, complete=False)  # a crash mid-save: ignored
    assert find_resume(tmp_path) is None


def test_latest_pointer_and_explicit_load(tmp_path):
    ckpts = tmp_path / "checkpoints"
    make_step(ckpts, 10)
    s20 = make_step(ckpts, 20)
    atomic_symlink_or_pointer(ckpts / "latest", s20.name)
    resume = find_resume(tmp_path)
    assert (resume.path, resume.step, resume.consumed_samples) == (s20, 20, 160)
    assert find_resume(tmp_path / "elsewhere", str(ckpts / "step_000010")).step == 10
    assert find_resume(tmp_path / "elsewhere", str(tmp_path)).step == 20  # a run directory
    assert find_resume(tmp_path / "elsewhere", str(ckpts)).step == 20


def test_missing_or_incomplete_explicit_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="step_000007 does not exist"):
        find_resume(tmp_path, str(tmp_path / "step_000007"))
    bad = make_step(tmp_path / "checkpoints", 3, complete=False)
    with pytest.raises(CheckpointError, match="incomplete or corrupt.*complete"):
        find_resume(tmp_path, str(bad))


def test_corrupt_latest_is_an_error_naming_the_file(tmp_path):
    ckpts = tmp_path / "checkpoints"
    make_step(ckpts, 10)
    (ckpts / "latest").write_text("")
    with pytest.raises(CheckpointError, match="latest is empty or corrupt"):
        find_resume(tmp_path)
    atomic_symlink_or_pointer(ckpts / "latest", "step_000099")
    with pytest.raises(CheckpointError, match="names 'step_000099'"):
        find_resume(tmp_path)
    (ckpts / "latest").unlink()
    with pytest.raises(CheckpointError, match="no latest pointer"):
        find_resume(tmp_path)


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for step in (1, 2, 3):
        make_step(tmp_path, step)
    make_step(tmp_path, 4, complete=False)
    (tmp_path / "step_000005.tmp").mkdir()
    prune(tmp_path, keep_last=2)
    assert [p.name for p in complete_steps(tmp_path)] == ["step_000002", "step_000003"]
    assert not (tmp_path / "step_000005.tmp").exists()
    prune(tmp_path, keep_last=0)
    assert len(complete_steps(tmp_path)) == 2


def test_save_clears_stale_tmp_dirs_and_records_the_run(tmp_path):
    """A save first removes every ``step_*.tmp`` (debris of a crash or a full disk, which would
    otherwise hold its space until a save of the same step) and stores the manager's records
    (architecture, layout, training) in trainwright.json."""
    from launcher.runtime.checkpoint import CheckpointManager
    from tests.helpers.checkpoints import FakeIO, record

    for stale in ("step_000003.tmp", "step_000007.tmp"):
        (tmp_path / stale).mkdir(parents=True)
        (tmp_path / stale / "model.pt").write_bytes(b"partial")
    manager = CheckpointManager(tmp_path, FakeIO(), keep_last=0, record=record())
    path = manager.save(5, consumed_samples=40, config={"a": 1}, plan={"b": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000005"]
    meta = json.loads((path / "trainwright.json").read_text())
    assert (meta["step"], meta["config"], meta["plan"]) == (5, {"a": 1}, {"b": 2})
    assert set(meta) >= {"architecture", "layout", "training"}
