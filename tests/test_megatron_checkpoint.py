"""engine=megatron checkpoints: dist-checkpointing (torch_dist) inside the atomic protocol.

Three 2-rank launches and one 4-rank launch. ``reshard_worker``: a checkpoint saved at TP=2 (plain
optimizer, zero_stage=0) or PP=2 (distributed optimizer, zero_stage=1, the preset's default) loads
at TP=1/PP=1 (DP=2) with the same loss on the next batch, and a resume on the same layout continues
bitwise for two steps (the second step depends on the restored Adam state); a MoE (EP=2)
distributed-optimizer checkpoint resumes bitwise and an EP=1 run refuses it (exit code 2). ``zero1_worker``: the
distributed optimizer at DP=2 saves before its first step and after two; the resume continues
bitwise; the checkpoint loads at TP=2 (DP=1) with the same loss and, after two more steps, a loss
within float noise of the DP=2 run; a zero_stage=0 run refuses it with a message naming both
layouts and the fix, and its model tensors alone reproduce the saved model. ``tp2dp2_worker`` (4
ranks): a TP=2 x DP=2 distributed-optimizer checkpoint continues at TP=1 x DP=4 within float noise.
``async_worker``: with trainer.async_save a save stays ``step_<N>.tmp`` until its background write
is finalised, and the resume from it is bitwise. ``async_stop_worker``: a TrainLoop whose stop
signal lands right after a deferred periodic save exits with that checkpoint complete.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers.engines import fixed_batches
from tests.helpers.megatron_checkpoints import (_batches, _finish, _load, _manager, _save, _steps,
                                                build)

TIED = ["model.untie_embeddings_and_output_weights=false"]
RESHARDABLE = TIED + ["engine.optimizer_checkpoint=fully_reshardable"]
"""What the layout-change tests save with: the distributed optimizer's model-space format (the
default, dp_reshardable, loads only where DP alone changed: tests/test_reshard_convert.py)."""


def _dp_share(batches: list) -> list:
    """This data-parallel rank's micro-batches of a global sequence (every DP-th one), so that
    layouts with different DP sizes train on the same global batches."""
    from megatron.core import parallel_state

    rank = parallel_state.get_data_parallel_rank()
    return batches[rank::parallel_state.get_data_parallel_world_size()]


RESHARD_LAYOUTS = {"tp2": ["parallelism=tp2", "parallelism.zero_stage=0"],
                   "pp2": ["parallelism=pp2", "parallelism.zero_stage=1"]}
"""Saved layouts of reshard_worker: TP=2 with the plain optimizer, PP=2 with the distributed one
(DP=1 on 2 ranks; loading at TP=1/PP=1 makes it DP=2)."""


def reshard_worker(args: dict) -> dict:
    """Save at TP=2 and at PP=2; load each at TP=1/PP=1 (DP=2); resume each on its layout."""
    root, out = Path(args["dir"]), {}
    for name, layout in RESHARD_LAYOUTS.items():
        ckpt = root / name / "checkpoints"
        cfg, plan, eng = build(RESHARDABLE + layout + ["trainer.global_batch_size=4"])
        batches = _batches(cfg, 8)
        out[f"{name}_train"] = _steps(eng, cfg, plan, batches[:4], 2)
        _save(eng, ckpt, 2)
        out[f"{name}_eval"] = eng.eval_loss(batches[4:6])
        out[f"{name}_next"] = _steps(eng, cfg, plan, batches[4:8], 2)
        _finish()
        cfg, plan, eng = build(RESHARDABLE + layout + ["trainer.global_batch_size=4"])
        _load(eng, ckpt)
        out[f"{name}_resumed"] = _steps(eng, cfg, plan, batches[4:8], 2)
        _finish()
        # TP=1, PP=1, DP=2, same optimizer kind
        cfg, plan, eng = build(RESHARDABLE + layout[1:] + ["trainer.global_batch_size=4"])
        _load(eng, ckpt)
        out[f"{name}_to_1_eval"] = eng.eval_loss(batches[4:6])
        out["latest"] = (ckpt / "latest").read_text().strip() if (ckpt / "latest").is_file() \
            else (ckpt / "latest").resolve().name
        out["files"] = sorted(p.name for p in (ckpt / "step_000002").iterdir())
        _finish()
    _moe_phase(root / "moe" / "checkpoints", out)
    return out


def _moe_phase(ckpt: Path, out: dict) -> None:
    """MoE (4 experts, EP=2) with the distributed optimizer: two DistributedOptimizers (dense and
    expert parameters); resume bitwise at EP=2; an EP=1 run (one optimizer) refuses it."""
    from launcher.core.errors import CheckpointError
    from tests.helpers.engines import MOE

    cfg, plan, eng = build(RESHARDABLE + MOE + ["parallelism.zero_stage=1",
                                                 "trainer.global_batch_size=4"])
    out["moe_optimizers"] = len(eng.optimizer.chained_optimizers)
    batches = _batches(cfg, 8)
    _steps(eng, cfg, plan, batches[:4], 2)
    _save(eng, ckpt, 2)
    out["moe_next"] = _steps(eng, cfg, plan, batches[4:8], 2)
    _finish()
    cfg, plan, eng = build(RESHARDABLE + MOE + ["parallelism.zero_stage=1",
                                                 "trainer.global_batch_size=4"])
    _load(eng, ckpt)
    out["moe_resumed"] = _steps(eng, cfg, plan, batches[4:8], 2)
    _finish()
    ep1 = [o for o in MOE if not o.startswith("parallelism.expert_parallel_size")]
    cfg, plan, eng = build(RESHARDABLE + ep1 + ["parallelism.zero_stage=1",
                                                 "trainer.global_batch_size=4"])
    try:
        _load(eng, ckpt)
        out["moe_ep1_error"] = None
    except CheckpointError as exc:
        out["moe_ep1_error"] = str(exc)
        out["moe_ep1_exit"] = getattr(exc, "exit_code", 1)
    _finish()


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    from tests.helpers.dist import run_distributed

    root = tmp_path_factory.mktemp("megatron_ckpt")
    return run_distributed("tests.test_megatron_checkpoint:reshard_worker", 2,
                           {"dir": str(root)})


@pytest.mark.xdist_group("checkpoint_reshard")  # its module fixture, built once
@pytest.mark.slow
def test_checkpoint_is_atomic_dist_checkpoint(reshard):
    r0 = reshard[0]
    assert r0["latest"] == "step_000002"
    assert {"complete", "megatron", "rng", "trainwright.json"} <= set(r0["files"])


@pytest.mark.xdist_group("checkpoint_reshard")  # its module fixture, built once
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_reshard_to_tp1_pp1_gives_the_same_loss(reshard, layout):
    for rank in reshard:
        saved, loaded = rank[f"{layout}_eval"], rank[f"{layout}_to_1_eval"]
        assert abs(saved - loaded) < 1e-5, (layout, saved, loaded)


@pytest.mark.xdist_group("checkpoint_reshard")  # its module fixture, built once
@pytest.mark.slow
def test_moe_distributed_optimizer_resumes_bitwise_at_ep2(reshard):
    for rank in reshard:
        assert rank["moe_optimizers"] == 2
        assert rank["moe_resumed"] == rank["moe_next"]


@pytest.mark.xdist_group("checkpoint_reshard")  # its module fixture, built once
@pytest.mark.slow
def test_moe_ep2_checkpoint_refused_at_ep1_with_both_layouts_and_the_fix(reshard):
    message = reshard[0]["moe_ep1_error"]
    assert message is not None
    assert "saved with zero_stage=1 (TP=1 PP=1 VPP=1 CP=1 EP=2 DP=2)" in message
    assert "this run uses zero_stage=1 (TP=1 PP=1 VPP=1 CP=1 EP=1 DP=2)" in message
    assert "holds 2 optimizer(s)" in message and "this run builds 1" in message
    assert "Resume with parallelism.expert_parallel_size=2" in message
    assert reshard[0]["moe_ep1_exit"] == 2  # a config error (IncompatibleCheckpoint)


@pytest.mark.xdist_group("checkpoint_reshard")  # its module fixture, built once
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_resume_on_the_same_layout_is_bitwise(reshard, layout):
    """Two steps: the second one depends on the restored optimizer state."""
    for rank in reshard:
        assert rank[f"{layout}_resumed"] == rank[f"{layout}_next"], layout
        assert len(rank[f"{layout}_next"]) == 2


ZERO1 = ["parallelism.zero_stage=1", "trainer.global_batch_size=4"]
TP2_DP1 = ["parallelism.tensor_parallel_size=2", "parallelism.sequence_parallel=true"]


def _train_and_save_zero1(ckpt: Path, out: dict) -> list:
    """DP=2 distributed optimizer: save before the first step and after two; then two more."""
    cfg, plan, eng = build(RESHARDABLE + ZERO1)
    batches = _batches(cfg, 16)
    out["eval_start"] = eng.eval_loss(batches[:2])
    _save(eng, ckpt, 0)  # a fresh optimizer has no Adam state yet
    out["eval_after_save0"] = eng.eval_loss(batches[:2])
    out["train"] = _steps(eng, cfg, plan, batches[:4], 2)
    _save(eng, ckpt, 2)
    out["eval0"] = eng.eval_loss(batches[8:10])
    out["next"] = _steps(eng, cfg, plan, _dp_share(batches[4:8]), 2)
    out["eval2"] = eng.eval_loss(batches[8:10])
    _finish()
    return batches


def _load_elsewhere(ckpt: Path, batches: list, out: dict) -> None:
    """The DP=2 checkpoint at TP=2 (DP=1), then refused by a zero_stage=0 run, whose model
    tensors alone (weights-only load) must still reproduce the saved model."""
    from launcher.core.errors import CheckpointError

    cfg, plan, eng = build(RESHARDABLE + ZERO1 + TP2_DP1)
    _load(eng, ckpt)
    out["tp2_eval0"] = eng.eval_loss(batches[8:10])
    out["tp2_next"] = _steps(eng, cfg, plan, _dp_share(batches[4:8]), 2)
    out["tp2_eval2"] = eng.eval_loss(batches[8:10])
    _finish()
    cfg, plan, eng = build(RESHARDABLE + ["parallelism.zero_stage=0",
                                          "trainer.global_batch_size=4"])
    try:
        _load(eng, ckpt)
        out["zero0_error"] = None
    except CheckpointError as exc:
        out["zero0_error"] = str(exc)
        out["zero0_exit"] = getattr(exc, "exit_code", 1)
    eng.checkpoint_io.read(ckpt / "step_000002", with_optimizer=False)
    out["weights_only_eval0"] = eng.eval_loss(batches[8:10])
    _finish()


def zero1_worker(args: dict) -> dict:
    """Distributed optimizer (zero_stage=1) at DP=2: see the module docstring."""
    ckpt, out = Path(args["dir"]) / "zero1" / "checkpoints", {}
    cfg, plan, eng = build(RESHARDABLE + ZERO1)
    out["fresh"] = _steps(eng, cfg, plan, _batches(cfg, 4), 2)  # never saved: the reference
    _finish()
    batches = _train_and_save_zero1(ckpt, out)
    cfg, plan, eng = build(RESHARDABLE + ZERO1)
    _load(eng, ckpt)
    out["resumed"] = _steps(eng, cfg, plan, _dp_share(batches[4:8]), 2)
    _finish()
    cfg, plan, eng = build(RESHARDABLE + ZERO1)
    from launcher.core import checkpoints

    _manager(eng, ckpt).load(checkpoints.find_resume(ckpt, str(ckpt / "step_000000")))
    out["from_step0"] = _steps(eng, cfg, plan, batches[:4], 2)
    _finish()
    _load_elsewhere(ckpt, batches, out)
    return out


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    from tests.helpers.dist import run_distributed

    root = tmp_path_factory.mktemp("megatron_zero1")
    return run_distributed("tests.test_megatron_checkpoint:zero1_worker", 2, {"dir": str(root)})


@pytest.mark.xdist_group("checkpoint_zero1")  # its module fixture, built once
@pytest.mark.slow
def test_zero1_save_of_a_fresh_optimizer_changes_nothing(zero1):
    """Saving before the first step primes the Adam state (Megatron-Core asserts on an empty one)
    without moving a weight or the step count: same eval loss, same two steps as a run that never
    saved, and a resume from that step-0 checkpoint repeats them."""
    for rank in zero1:
        assert rank["eval_after_save0"] == rank["eval_start"]
        assert rank["train"] == rank["fresh"]
        assert rank["from_step0"] == rank["fresh"]
        # an untrained model: near-uniform logits over the 512-token vocabulary
        assert rank["fresh"][0][0] == pytest.approx(math.log(512), abs=0.05)


@pytest.mark.xdist_group("checkpoint_zero1")  # its module fixture, built once
@pytest.mark.slow
def test_zero1_resume_on_the_same_layout_is_bitwise(zero1):
    """Loss and grad norm of the two steps after the resume equal the uninterrupted run's; the
    second depends on the restored Adam moments and step count."""
    for rank in zero1:
        assert rank["resumed"] == rank["next"]
        assert rank["next"][1][0] < rank["next"][0][0]


@pytest.mark.xdist_group("checkpoint_zero1")  # its module fixture, built once
@pytest.mark.slow
def test_zero1_dp2_checkpoint_loads_at_tp2_dp1(zero1):
    """Resharded TP=1 DP=2 -> TP=2 DP=1: same eval loss, and two steps later (Adam state moved
    with the weights) loss, grad norm and eval loss within float noise of the DP=2 run. Without
    the optimizer state the second step's loss is about 0.04 off, far outside the tolerance."""
    for rank in zero1:
        assert abs(rank["tp2_eval0"] - rank["eval0"]) < 1e-5
        for (loss, norm), (ref_loss, ref_norm) in zip(rank["tp2_next"], rank["next"]):
            assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5
        assert abs(rank["tp2_eval2"] - rank["eval2"]) < 1e-5


@pytest.mark.xdist_group("checkpoint_zero1")  # its module fixture, built once
@pytest.mark.slow
def test_zero1_checkpoint_refused_by_zero_stage_0_with_both_layouts_and_the_fix(zero1):
    message = zero1[0]["zero0_error"]
    assert message is not None
    assert "saved with zero_stage=1 (TP=1 PP=1 VPP=1 CP=1 EP=1 DP=2)" in message
    assert "this run uses zero_stage=0 (TP=1 PP=1 VPP=1 CP=1 EP=1 DP=2)" in message
    assert "Resume with parallelism.zero_stage=1" in message
    assert "step_000002/megatron" in message
    assert zero1[0]["zero0_exit"] == 2  # a config error (IncompatibleCheckpoint)


@pytest.mark.xdist_group("checkpoint_zero1")  # its module fixture, built once
@pytest.mark.slow
def test_zero1_saved_model_tensors_are_the_trained_weights(zero1):
    """With overlap_param_gather (the megatron preset) the other ranks' shards are one update
    behind until the next forward; the save gathers them first, so the model tensors alone
    (weights-only load) reproduce the saved model's loss (stale ones gave 6.099 vs 6.029)."""
    for rank in zero1:
        assert rank["weights_only_eval0"] == rank["eval0"]


def tp2dp2_worker(args: dict) -> dict:
    """4 ranks: distributed optimizer at TP=2 x DP=2 (ZeRO-1 shards of TP shards), saved after
    two steps, then two more; loaded at TP=1 x DP=4 for the same two steps."""
    ckpt, out = Path(args["dir"]) / "tp2dp2" / "checkpoints", {}
    common = RESHARDABLE + ["parallelism.zero_stage=1", "trainer.global_batch_size=8"]
    layouts = {"tp2dp2": TP2_DP1, "tp1dp4": []}
    for name, layout in layouts.items():
        cfg, plan, eng = build(common + layout)
        batches = _batches(cfg, 16)
        if name == "tp2dp2":
            _steps(eng, cfg, plan, _dp_share(batches[:8]), 2)
            _save(eng, ckpt, 2)
        else:
            _load(eng, ckpt)
        out[f"{name}_eval0"] = eng.eval_loss(batches[8:10])
        out[f"{name}_next"] = _steps(eng, cfg, plan, _dp_share(batches[8:16]), 2)
        out[f"{name}_eval2"] = eng.eval_loss(batches[8:10])
        _finish()
    return out


@pytest.fixture(scope="module")
def tp2dp2(tmp_path_factory):
    from tests.helpers.dist import run_distributed

    root = tmp_path_factory.mktemp("megatron_tp2dp2")
    return run_distributed("tests.test_megatron_checkpoint:tp2dp2_worker", 4, {"dir": str(root)})


@pytest.mark.slow
def test_zero1_tp2_dp2_checkpoint_loads_at_tp1_dp4(tp2dp2):
    """Both the TP and the ZeRO-1 sharding change: eval loss before and after two steps, and
    their losses and grad norms, within float noise (1e-5; measured <= 1e-6)."""
    for rank in tp2dp2:
        assert abs(rank["tp1dp4_eval0"] - rank["tp2dp2_eval0"]) < 1e-5
        for (loss, norm), (ref_loss, ref_norm) in zip(rank["tp1dp4_next"], rank["tp2dp2_next"]):
            assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5
        assert abs(rank["tp1dp4_eval2"] - rank["tp2dp2_eval2"]) < 1e-5
        assert rank["tp2dp2_eval2"] < rank["tp2dp2_eval0"] - 0.1


ASYNC = ZERO1 + ["trainer.async_save=true"]  # train_steps=8 (engines.TINY): step 8 is the last


def _listing(ckpt: Path) -> dict:
    """{name: has 'complete'} of a checkpoints directory, plus where ``latest`` points."""
    from launcher.core import checkpoints

    names = {p.name: (p / checkpoints.COMPLETE).is_file() for p in ckpt.iterdir()
             if p.name != checkpoints.LATEST}
    resume = checkpoints.find_resume(ckpt.parent)
    return {"dirs": names, "resume": resume.path.name if resume else None}


def _defers(eng, directory: Path) -> dict:
    """Whether a save stays pending (background write) at a middle step, at the last step, and
    as the loop saves on a stop request (background=False)."""
    manager = _manager(eng, directory)
    out = {}
    for name, step, background in (("mid", 5, True), ("last", 8, True), ("stop", 6, False)):
        _save(eng, directory, step, background)
        out[name] = manager.pending
        manager.wait()
    return out


def async_worker(args: dict) -> dict:
    """trainer.async_save at DP=2 (distributed optimizer): deferred saves at steps 2 and 4,
    completed only by the manager's wait; resume from step 4."""
    ckpt, out = Path(args["dir"]) / "async" / "checkpoints", {}
    cfg, plan, eng = build(TIED + ASYNC)
    batches = _batches(cfg, 16)
    _steps(eng, cfg, plan, batches[:4], 2)
    _save(eng, ckpt, 2)
    out["after_save2"] = _listing(ckpt)
    _manager(eng, ckpt).wait()
    out["after_finish2"] = _listing(ckpt)
    _steps(eng, cfg, plan, batches[4:8], 2)
    _save(eng, ckpt, 4)
    out["after_save4"] = _listing(ckpt)
    out["next"] = _steps(eng, cfg, plan, batches[8:12], 2)  # training goes on meanwhile
    _manager(eng, ckpt).wait()
    out["after_finish4"] = _listing(ckpt)
    out["defers"] = _defers(eng, ckpt.parent / "defers")
    _finish()
    cfg, plan, eng = build(TIED + ASYNC)
    _load(eng, ckpt)
    out["resumed"] = _steps(eng, cfg, plan, batches[8:12], 2)
    _finish()
    return out


@pytest.fixture(scope="module")
def async_save(tmp_path_factory):
    from tests.helpers.dist import run_distributed

    root = tmp_path_factory.mktemp("megatron_async")
    return run_distributed("tests.test_megatron_checkpoint:async_worker", 2, {"dir": str(root)})


@pytest.mark.xdist_group("checkpoint_async")  # its module fixture, built once
@pytest.mark.slow
def test_async_save_gets_its_final_name_only_after_the_writes(async_save):
    """A deferred save stays step_<N>.tmp without 'complete' (latest unchanged, so a crash resumes
    from the previous checkpoint) until the manager completes it; then it is step_<N> and latest."""
    r0 = async_save[0]
    assert r0["after_save2"] == {"dirs": {"step_000002.tmp": False}, "resume": None}
    assert r0["after_finish2"] == {"dirs": {"step_000002": True}, "resume": "step_000002"}
    assert r0["after_save4"] == {"dirs": {"step_000002": True, "step_000004.tmp": False},
                                 "resume": "step_000002"}
    assert r0["after_finish4"] == {"dirs": {"step_000002": True, "step_000004": True},
                                   "resume": "step_000004"}


@pytest.mark.xdist_group("checkpoint_async")  # its module fixture, built once
@pytest.mark.slow
def test_async_save_resumes_bitwise(async_save):
    """The background write holds the weights and Adam state of the save's step although
    training went on while it ran."""
    for rank in async_save:
        assert rank["resumed"] == rank["next"]


@pytest.mark.xdist_group("checkpoint_async")  # its module fixture, built once
@pytest.mark.slow
def test_async_save_is_synchronous_at_the_last_step_and_on_a_stop_request(async_save):
    for rank in async_save:
        assert rank["defers"] == {"mid": True, "last": False, "stop": False}


class _SignalOnLog:
    """Metrics stub: on rank 1, SIGUSR1 arrives while step ``at`` is logged, i.e. after that
    step's periodic (deferred) save and before the loop's stop check."""

    def __init__(self, at: int):
        self.at, self.events = at, []

    def log(self, step: int, metrics: dict) -> None:
        import os
        import signal

        import torch

        if step == self.at and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)

    def log_event(self, kind: str, message: str, **fields) -> None:
        self.events.append(kind)


def async_stop_worker(args: dict) -> dict:
    """TrainLoop with trainer.async_save and save_interval=2: a stop signal to rank 1 lands between
    the deferred save of step 2 and the stop check; the loop must complete that save on exit."""
    from launcher.core.phases import PhaseTimer
    from launcher.core.stop import StopRequest
    from launcher.parallel import collectives
    from launcher.runtime.loop import TrainLoop

    ckpt = Path(args["dir"]) / "async_stop" / "checkpoints"
    stop = StopRequest("SIGUSR1", any_rank=collectives.any_rank)
    cfg, plan, eng = build(TIED + ASYNC + ["trainer.save_interval=2", "trainer.eval_interval=0",
                                           "trainer.straggler_interval=0"])
    metrics = _SignalOnLog(at=2)
    loop = TrainLoop(engine=eng, plan=plan, trainer=cfg.trainer, optimizer=cfg.optimizer,
                     next_batch=fixed_batches(cfg.model.vocab_size, cfg.model.seq_length,
                                              cfg.trainer.micro_batch_size, 3),
                     eval_batches=None, metrics=metrics, timer=PhaseTimer(), stop=stop,
                     checkpoints=_manager(eng, ckpt), saved_extras={"config": {}, "plan": {}})
    out = {"code": loop.run(), "step": loop.state.step, "events": metrics.events,
           "pending": _manager(eng, ckpt).pending}
    out["listing"] = _listing(ckpt)
    _manager(eng, ckpt).wait()  # without the fix: let the writer finish cleanly
    stop.restore()
    _finish()
    return out


@pytest.mark.slow
def test_stop_right_after_an_async_save_completes_that_checkpoint(tmp_path):
    """The stop check finds step 2 already saved (deferred); before exiting for requeue the loop
    waits for its write, so step_000002 is complete and latest names it (no second save)."""
    from launcher.core.exits import REQUEUE_EXIT
    from tests.helpers.dist import run_distributed

    for rank in run_distributed("tests.test_megatron_checkpoint:async_stop_worker", 2,
                                {"dir": str(tmp_path)}):
        assert rank["listing"] == {"dirs": {"step_000002": True}, "resume": "step_000002"}
        assert (rank["code"], rank["step"], rank["pending"]) == (REQUEUE_EXIT, 2, False)
        assert rank["events"] == ["stop"]


def stop_before_first_step_worker(args: dict) -> dict:
    """TrainLoop whose stop signal (rank 1 only) arrived after start-up ended and before its first
    step: the ranks agree once before it, so none runs, nothing is saved, and nothing is started
    that the process's exit would wait for (the save-results queue's warm-up)."""
    import os
    import signal

    import torch

    from launcher.core.phases import PhaseTimer
    from launcher.core.stop import StopRequest
    from launcher.parallel import collectives
    from launcher.runtime.loop import TrainLoop

    ckpt = Path(args["dir"]) / "stop_first" / "checkpoints"
    stop = StopRequest("SIGUSR1", any_rank=collectives.any_rank)
    cfg, plan, eng = build(TIED + ["trainer.save_interval=2", "trainer.eval_interval=0",
                                   "trainer.straggler_interval=0"])
    metrics = _SignalOnLog(at=-1)
    loop = TrainLoop(engine=eng, plan=plan, trainer=cfg.trainer, optimizer=cfg.optimizer,
                     next_batch=fixed_batches(cfg.model.vocab_size, cfg.model.seq_length,
                                              cfg.trainer.micro_batch_size, 3),
                     eval_batches=None, metrics=metrics, timer=PhaseTimer(), stop=stop,
                     checkpoints=_manager(eng, ckpt), saved_extras={"config": {}, "plan": {}})
    if torch.distributed.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    out = {"code": loop.run(), "step": loop.state.step, "events": metrics.events,
           "saved": sorted(p.name for p in ckpt.iterdir()) if ckpt.exists() else []}
    stop.restore()
    _finish()
    return out


@pytest.mark.slow
def test_a_stop_between_start_up_and_the_first_step_runs_no_step_and_saves_nothing(tmp_path):
    """Before the fix the ranks agreed only after a step: step 1 ran after the signal and was
    saved."""
    from launcher.core.exits import REQUEUE_EXIT
    from tests.helpers.dist import run_distributed

    for rank in run_distributed("tests.test_megatron_checkpoint:stop_before_first_step_worker", 2,
                                {"dir": str(tmp_path)}):
        assert (rank["code"], rank["step"], rank["saved"]) == (REQUEUE_EXIT, 0, []), rank
        assert rank["events"] == ["stop"]
