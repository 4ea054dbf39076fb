"""Resume safety (launcher.runtime.resume, confighistory, diskfull): a checkpoint records its
architecture, layout and batch; a resume refuses a different architecture before loading
anything (exit 2, every field named), reports changed batches and schedules as events, stops at
once when train_steps is already reached, keeps the last good config.yaml, names every tensor of
a failed load, and reports a full disk as such with the previous checkpoint intact.

The fast tests run in-process on hand-written step directories; the slow ones train a tiny model
through ``python -m launcher.train`` (one process each) and resume it changed.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from launcher.core.atomic import atomic_symlink_or_pointer
from launcher.core.checkpoints import Resume, find_resume, step_name
from launcher.core.errors import CheckpointError, IncompatibleCheckpoint
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.runtime import checkpoint, resume as rs
from launcher.runtime.checkpoint import CheckpointManager
from launcher.runtime.confighistory import attempts
from launcher.runtime.rundir import prepare_run_dir, write_run_files
from tests.helpers.checkpoints import MODEL, PLAN, FakeIO, record


def step_dir(ckpts: Path, step: int, meta: dict) -> Resume:
    path = ckpts / step_name(step)
    path.mkdir(parents=True)
    (path / "trainwright.json").write_text(json.dumps(
        {"step": step, "consumed_samples": 8 * step, **meta}))
    (path / "complete").write_text(f"{step}\n")
    atomic_symlink_or_pointer(ckpts / "latest", path.name)
    return find_resume(ckpts.parent)


class Events:
    def __init__(self):
        self.events = []

    def log_event(self, kind, message, **fields):
        self.events.append((kind, message, fields))


def test_architecture_record_resolves_sentinels_and_leaves_out_training_settings():
    arch = rs.architecture({**MODEL, "num_query_groups": 0, "hidden_dropout": 0.1})
    assert arch["num_query_groups"] == 8 and arch["kv_channels"] == 8
    assert arch["vocab_size"] == 512 and arch["position_embedding"] == "rope"
    assert arch["normalization"] == "RMSNorm" and arch["max_position_embeddings"] is None
    assert set(arch) == set(rs.ARCHITECTURE_KEYS)
    assert rs.architecture({**MODEL, "hidden_dropout": 0.3, "init_method_std": 1.0,
                            "moe_aux_loss_coeff": 1.0}) == rs.architecture(MODEL)
    gpt2 = rs.architecture({**MODEL, "arch": "gpt2", "seq_length": 128})
    assert (gpt2["max_position_embeddings"], gpt2["rotary_base"]) == (128, None)


def test_the_router_weighting_is_architecture_as_are_experts():
    """Qwen3-MoE without norm_topk_prob and Mixtral have the same tensors; only the router's
    weighting of the chosen experts tells them apart, so a resume must not change it."""
    moe = {**MODEL, "num_experts": 4, "moe_router_topk": 2}
    assert rs.architecture(moe)["moe_router_pre_softmax"] is False
    assert rs.architecture({**moe, "moe_router_pre_softmax": True})["moe_router_pre_softmax"]
    assert rs.architecture({**MODEL, "moe_router_pre_softmax": True}) == rs.architecture(MODEL)


def test_changed_heads_with_the_same_shapes_are_refused_naming_every_field(tmp_path):
    """Heads 8 -> 16 and groups 4 -> 8 keep every tensor's shape (kv_channels 8 -> 4): the load
    would succeed silently; the check refuses before anything is read, exit 2."""
    resume = step_dir(tmp_path / "checkpoints", 10, record())
    now = record({"num_attention_heads": 16, "num_query_groups": 8})
    with pytest.raises(IncompatibleCheckpoint) as exc:
        rs.refuse_incompatible(resume, now)
    message = str(exc.value)
    assert exc.value.exit_code == CONFIG_ERROR_EXIT == 2
    assert "model.num_attention_heads: checkpoint 8, now 16; model.num_query_groups: " \
           "checkpoint 4, now 8; model.kv_channels: checkpoint 8, now 4" in message
    assert "model.num_attention_heads=8 model.num_query_groups=4 model.kv_channels=8" in message
    assert "new run" in message and "run.name" in message and "Nothing was loaded" in message
    rs.refuse_incompatible(resume, record())  # the same architecture passes
    rs.refuse_incompatible(resume, record(plan={"tensor_parallel_size": 2, "world_size": 4}))


def test_old_checkpoint_is_checked_against_its_saved_config_and_engine(tmp_path):
    """A checkpoint without the record: the config saved beside it still tells its model."""
    resume = step_dir(tmp_path / "checkpoints", 4, {
        "config": {"model": MODEL, "parallelism": {"tensor_parallel_size": 1}}, "plan": PLAN})
    with pytest.raises(IncompatibleCheckpoint, match=r"model.hidden_size: checkpoint 64, now 128"):
        rs.refuse_incompatible(resume, record({"hidden_size": 128}))
    with pytest.raises(IncompatibleCheckpoint, match=r"engine: checkpoint deepspeed, now "
                                                      r"megatron.*engine=deepspeed"):
        rs.refuse_incompatible(resume, record(plan={"engine": "megatron"}))
    with pytest.raises(IncompatibleCheckpoint, match=r"normalization \(from model.arch\): "
                                                      r"checkpoint RMSNorm, now LayerNorm.*"
                                                      r"model.arch=llama"):
        rs.refuse_incompatible(resume, record({"arch": "gpt2"}))
    bare = step_dir(tmp_path / "bare" / "checkpoints", 4, {"config": {}, "plan": {}})
    rs.refuse_incompatible(bare, record({"hidden_size": 128}))  # nothing recorded: the load tells


def test_changed_batches_schedule_and_layout_are_events(tmp_path):
    resume = step_dir(tmp_path / "checkpoints", 10, record())
    now = record(plan={"global_batch_size": 16, "micro_batch_size": 4, "grad_accum_steps": 4,
                       "train_steps": 40, "data_parallel_size": 1, "world_size": 1})
    from launcher.config import OptimizerConfig

    events = Events()
    rs.report_changes(resume, now, events, OptimizerConfig(warmup_steps=0))
    text = "\n".join(f"{kind}: {message}" for kind, message, _ in events.events)
    assert "batch_change: global batch changed from 8 to 16 at step 10: consumed samples " \
           "continue at 80" in text
    assert "micro batch changed from 2 to 4 at step 10: 4 accumulation step(s)" in text
    assert "schedule_change: train steps changed from 20 to 40 at step 10" in text
    assert "layout_change: parallel layout changed from TP=1 PP=1 VPP=1 CP=1 EP=1 DP=2 " \
           "ZeRO=1 to TP=1 PP=1 VPP=1 CP=1 EP=1 DP=1 ZeRO=1" in text
    assert all(fields["step"] == 10 for _, _, fields in events.events)
    quiet = Events()
    rs.report_changes(resume, record(), quiet)
    assert quiet.events == []


@pytest.mark.parametrize("train_steps", [10, 6])
def test_train_steps_already_reached_is_an_event_and_nothing_to_do(tmp_path, train_steps):
    resume = step_dir(tmp_path / "checkpoints", 10, record())
    events = Events()
    assert rs.already_trained(resume, train_steps, events)
    (kind, message, fields), = events.events
    assert kind == "already_trained" and "nothing to train" in message and "step 10" in message
    assert "exiting 0" in message and "raise trainer.train_steps" in message
    assert not rs.already_trained(resume, 11, Events())
    assert not rs.already_trained(None, 11, Events())


def test_a_restart_keeps_config_yaml_until_it_has_loaded(tmp_path):
    """First start: config.yaml at once, no history. A restart records its config as the next
    attempt and leaves config.yaml (the last good run's) alone until write_run_files."""
    run_dir = tmp_path / "run"
    good = {"model": {"num_attention_heads": 8}, "data": {}}
    tried = {"model": {"num_attention_heads": 16}, "data": {}}
    prepare_run_dir(run_dir, config=good, plan={"world_size": 1})
    assert not (run_dir / "configs").exists()
    prepare_run_dir(run_dir, config=tried, plan={"world_size": 2})
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == good
    assert json.loads((run_dir / "plan.json").read_text()) == {"world_size": 1}
    first, second = attempts(run_dir)
    assert first.name.startswith("attempt_0001_") and second.name.startswith("attempt_0002_")
    assert yaml.safe_load(first.read_text()) == good
    assert yaml.safe_load(second.read_text()) == tried
    write_run_files(run_dir, config=tried, plan={"world_size": 2}, extra={"ds.json": {"a": 1}})
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == tried
    assert json.loads((run_dir / "ds.json").read_text()) == {"a": 1}
    prepare_run_dir(run_dir, config=good, plan={})
    assert [p.name[:12] for p in attempts(run_dir)] == ["attempt_0001", "attempt_0002",
                                                         "attempt_0003"]


def test_checkpoint_metadata_holds_the_records(tmp_path):
    manager = CheckpointManager(tmp_path, FakeIO(), keep_last=2, record=record())
    path = manager.save(3, consumed_samples=24, config={}, plan={})
    meta = json.loads((path / "trainwright.json").read_text())
    assert meta["architecture"]["num_attention_heads"] == 8
    assert meta["layout"]["data_parallel_size"] == 2 and meta["training"]["train_steps"] == 20


def test_a_failed_load_names_every_tensor_and_both_shapes(tmp_path):
    """torch lists each mismatch on its own line; only the first line ('Error(s) in loading
    state_dict for Sequential:') used to reach the message."""
    saved = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    now = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Linear(128, 32, bias=False))
    try:
        now.load_state_dict(saved.state_dict())
    except RuntimeError as exc:
        error = exc
    resume = step_dir(tmp_path / "checkpoints", 2, record())
    with pytest.raises(CheckpointError) as exc:
        checkpoint.load(FakeIO(read_error=error), resume)
    message = str(exc.value)
    assert "Unexpected key(s) in state_dict: \"1.bias\"" in message
    assert "size mismatch for 0.weight: copying a param with shape torch.Size([128, 64]) from " \
           "checkpoint, the shape in current model is torch.Size([128, 32])" in message
    assert "size mismatch for 1.weight" in message
    assert "trainwright.json" in message and "run.name" in message


TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 3712 vs 3604"


def _saved_twice(tmp_path: Path, io, first_io=None) -> tuple:
    """Save step 1 (with ``first_io``), then step 2 with ``io``: (the CheckpointError of step 2,
    step 1's directory)."""
    ckpts = tmp_path / "checkpoints"
    first = CheckpointManager(ckpts, first_io or FakeIO(1000), keep_last=1).save(
        1, consumed_samples=8, config={}, plan={})
    with pytest.raises(CheckpointError) as exc:
        CheckpointManager(ckpts, io, keep_last=1).save(2, consumed_samples=16, config={},
                                                        plan={})
    return str(exc.value), first


def test_disk_full_in_torch_save_is_reported_as_such(tmp_path, monkeypatch):
    """torch's zip writer says 'unexpected pos' on a full disk; with no space left on the
    filesystem the save reports that, the directory and the free space."""

    class FullDiskIO(FakeIO):
        def write(self, step_dir, *, background):
            step_dir.mkdir(parents=True, exist_ok=True)
            (step_dir / "model.pt").write_bytes(b"partial")
            raise RuntimeError(TORCH_FULL)

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: type(usage)(usage.total,
                                                                        usage.total, 0))
    message, first = _saved_twice(tmp_path, FullDiskIO())
    assert f"no space left on {tmp_path / 'checkpoints' / 'step_000002.tmp'} (0 B free of" in \
        message
    assert "latest = step_000001) is intact" in message and "unexpected pos" in message
    assert find_resume(tmp_path).path == first and (first / "model.pt").is_file()
    assert not (tmp_path / "checkpoints" / "step_000002.tmp").exists()


def test_enospc_is_reported_and_other_write_errors_name_the_path(tmp_path):
    class NoSpaceIO(FakeIO):
        def write(self, step_dir, *, background):
            raise OSError(errno.ENOSPC, "No space left on device", str(step_dir / "x.pt"))

    message, _ = _saved_twice(tmp_path / "a", NoSpaceIO())
    assert message.startswith("no space left on ") and "free of" in message

    class BrokenIO(FakeIO):
        def write(self, step_dir, *, background):
            raise OSError(errno.EIO, "Input/output error")

    message, _ = _saved_twice(tmp_path / "b", BrokenIO())
    assert message.startswith("cannot write checkpoint files under ") and "free of" in message

    class BugIO(FakeIO):
        def write(self, step_dir, *, background):
            raise RuntimeError("a bug, not a disk")

    with pytest.raises(RuntimeError, match="a bug"):
        CheckpointManager(tmp_path / "c", BugIO(), keep_last=1).save(
            1, consumed_samples=8, config={}, plan={})


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    """A 1 MiB tmpfs (needs root and mount; skipped elsewhere)."""
    return mount_tmpfs("1m")


def test_a_really_full_disk_keeps_the_previous_checkpoint(small_tmpfs):
    """600 KB checkpoints on a 1 MiB filesystem: the second save runs out of space inside
    torch.save (torch's own 'unexpected pos' error)."""
    message, first = _saved_twice(small_tmpfs, FakeIO(600_000), FakeIO(600_000))
    assert "no space left on" in message and str(small_tmpfs / "checkpoints") in message
    assert "free of 1.0 MiB" in message and "latest = step_000001" in message
    assert find_resume(small_tmpfs).path == first
    assert torch.load(first / "model.pt")["w"].numel() == 150_000
    assert not (small_tmpfs / "checkpoints" / "step_000002.tmp").exists()


def _ds_files(tmp_path: Path, names: list) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def test_deepspeed_refuses_only_what_it_cannot_convert(tmp_path):
    """TP, optimizer-state format (ZeRO 0 / 1-2 / 3) and, under ZeRO, DP; ZeRO 1 <-> 2 and DP at
    ZeRO 0 load (checked on real DeepSpeed 0.19.8 checkpoints: DP 2 -> 1 at ZeRO-1 raises
    ZeRORuntimeException, ZeRO 0 -> 1 FileNotFoundError, 1 -> 0 AttributeError, 1 -> 3 and
    TP 2 -> 1 AssertionError; 1 -> 2 resumes)."""
    from launcher.engines.deepspeed.engine import check_layout
    from launcher.engines.deepspeed.files import saved_layout

    zero1 = saved_layout(_ds_files(tmp_path / "z1", [
        "mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "trainwright.json"]))
    assert zero1 == {"tp": 1, "dp": 2, "zero": "ZeRO stage 1/2"}
    zero3 = saved_layout(_ds_files(tmp_path / "z3", [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]))
    assert zero3 == {"tp": 1, "dp": 1, "zero": "ZeRO stage 3"}
    plain_tp2 = saved_layout(_ds_files(tmp_path / "z0", [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]))
    assert plain_tp2 == {"tp": 2, "dp": None, "zero": "ZeRO stage 0"}
    check_layout(zero1, {"tp": 1, "dp": 2, "zero": "ZeRO stage 1/2"}, tmp_path)
    check_layout(plain_tp2, {"tp": 2, "dp": 4, "zero": "ZeRO stage 0"}, tmp_path)
    with pytest.raises(IncompatibleCheckpoint, match=r"partitioned over 2 data-parallel ranks, "
                                                      r"this run has 1.*DP=2 \(a world size "
                                                      r"of 2 at TP=1\)") as exc:
        check_layout(zero1, {"tp": 1, "dp": 1, "zero": "ZeRO stage 1/2"}, tmp_path)
    assert exc.value.exit_code == 2
    with pytest.raises(IncompatibleCheckpoint, match=r"ZeRO stage 1/2 format, this run uses "
                                                      r"ZeRO stage 3.*zero_stage=1 or 2"):
        check_layout(zero1, {"tp": 1, "dp": 2, "zero": "ZeRO stage 3"}, tmp_path)
    with pytest.raises(IncompatibleCheckpoint, match=r"2 tensor-parallel shard\(s\), this run has "
                                                      r"TP=1: .*tensor_parallel_size=2; its "
                                                      r"optimizer state is in the ZeRO stage 0"):
        check_layout(plain_tp2, {"tp": 1, "dp": 2, "zero": "ZeRO stage 1/2"}, tmp_path)


# --- end to end: python -m launcher.train on one CPU process --------------------------------

HEADS_8 = ["cluster.gpus_per_node=1", "model.num_attention_heads=8", "model.num_query_groups=4",
           "trainer.global_batch_size=4", "trainer.eval_interval=0"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """Two steps of a tiny model with 8 heads in 4 groups, checkpointed at step 2."""
    from tests.helpers.training import train

    tmp = tmp_path_factory.mktemp("resume_safety")
    train(tmp, "base", *HEADS_8, "trainer.train_steps=2")
    return tmp / "base"


def _copy(base_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(base_run, tmp_path / "run", ignore=shutil.ignore_patterns("*.lock", "*.pid"))
    return tmp_path


def _events(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resume_with_other_heads_exits_2_and_keeps_the_last_good_config(base_run, tmp_path):
    """16 heads in 8 groups: every tensor keeps its shape, so the load used to succeed and train
    on. Now: exit 2 before anything is built, every field named; config.yaml still says 8."""
    from tests.helpers.training import train

    tmp = _copy(base_run, tmp_path)
    proc = train(tmp, "run", *HEADS_8, "model.num_attention_heads=16",
                 "model.num_query_groups=8", "trainer.train_steps=4", expect=2)
    assert "model.num_attention_heads: checkpoint 8, now 16; model.num_query_groups: " \
           "checkpoint 4, now 8" in proc.stderr
    assert "model.num_attention_heads=8 model.num_query_groups=4" in proc.stderr
    run_dir = tmp / "run"
    assert not (run_dir / "checkpoints" / "step_000004").exists()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"][
        "num_attention_heads"] == 8
    good, tried = attempts(run_dir)
    assert yaml.safe_load(good.read_text())["model"]["num_attention_heads"] == 8
    assert yaml.safe_load(tried.read_text())["model"]["num_attention_heads"] == 16
    *rank_events, end = _events(run_dir)
    assert rank_events[-1]["kind"] == "abort"
    assert (end["kind"], end["outcome"], end["exit_code"]) == ("run_end", "failed", 2)


@pytest.mark.slow
def test_batch_change_is_reported_and_reached_train_steps_exits_0(base_run, tmp_path):
    from tests.helpers.training import steps_of, train

    tmp = _copy(base_run, tmp_path)
    run_dir = tmp / "run"
    proc = train(tmp, "run", *HEADS_8, "trainer.global_batch_size=8", "trainer.train_steps=3")
    message = "global batch changed from 4 to 8 at step 2: consumed samples continue at 8"
    assert message in proc.stdout
    kinds = {e["kind"]: e for e in _events(run_dir)}
    assert message in kinds["batch_change"]["message"] and kinds["batch_change"]["step"] == 2
    assert "train steps changed from 2 to 3" in kinds["schedule_change"]["message"]
    assert steps_of(run_dir)[3]["consumed_samples"] == 16
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"][
        "global_batch_size"] == 8  # this start got going: config.yaml is its config now
    lines = (run_dir / "metrics.jsonl").read_text()
    proc = train(tmp, "run", *HEADS_8, "trainer.global_batch_size=8", "trainer.train_steps=3")
    assert "nothing to train: checkpoint" in proc.stdout and "step 3" in proc.stdout
    *rank_events, end = _events(run_dir)
    assert rank_events[-1]["kind"] == "already_trained"
    assert (end["kind"], end["outcome"]) == ("run_end", "finished")
    assert (run_dir / "metrics.jsonl").read_text() == lines


@pytest.mark.slow
def test_old_checkpoint_with_other_hidden_size_names_every_tensor(base_run, tmp_path):
    """Without the recorded architecture (nor the config) only the load can tell: its error
    names the tensors and both shapes, not just torch's first line."""
    from tests.helpers.training import train

    tmp = _copy(base_run, tmp_path)
    meta_file = tmp / "run" / "checkpoints" / "step_000002" / "trainwright.json"
    meta = json.loads(meta_file.read_text())
    for key in ("architecture", "config"):
        meta.pop(key)
    meta_file.write_text(json.dumps(meta))
    proc = train(tmp, "run", *HEADS_8, "model.hidden_size=128", "trainer.train_steps=4",
                 expect=1)
    assert "size mismatch for embedding.word_embeddings.weight: copying a param with shape " \
           "torch.Size([512, 64]) from checkpoint, the shape in current model is " \
           "torch.Size([512, 128])" in proc.stderr
    assert proc.stderr.count("size mismatch for ") >= 5
    assert "records no architecture" in (tmp / "run" / "events.jsonl").read_text()


def test_a_changed_stage_split_is_a_layout_change(tmp_path):
    """layers_in_first/last_stage move layers between stages: the resume reports it, and a
    checkpoint written before the split was recorded (no stage_layers) is not a change."""
    even = {"pipeline_parallel_size": 2, "stage_layers": (4, 4)}
    resume = step_dir(tmp_path / "checkpoints", 10, record(plan=even))
    events = Events()
    rs.report_changes(resume, record(plan={**even, "stage_layers": (3, 5)}), events)
    (kind, message, _), = events.events
    assert kind == "layout_change" and "PP=2" in message and message.endswith(
        "stages=[3, 5] at step 10: the engine resharded the checkpoint"), message
    same = Events()
    rs.report_changes(resume, record(plan=even), same)
    assert same.events == []
    old = record(plan=even)
    del old["layout"]["stage_layers"]
    legacy = step_dir(tmp_path / "legacy" / "checkpoints", 10, old)
    quiet = Events()
    rs.report_changes(legacy, record(plan=even), quiet)
    assert quiet.events == []
