"""``python -m launcher.train [overrides]``: train the configured model.

compose (exit 2 on config errors) -> plan (exit 2 on plan problems) -> start one process per
local GPU when not already launched -> init process groups -> run directory -> data, engine ->
resume -> :class:`launcher.loop.TrainLoop` -> close. Exit codes: 0 done, 2 config error,
3 non-finite loss/gradient (launcher.loop), 75 stopped for requeue (launcher.signals), 1 other.
"""

from __future__ import annotations

import itertools
import os
import sys
import uuid
from pathlib import Path
from typing import Sequence

from launcher.compose import CONFIG_ERROR_EXIT, compose_or_exit, to_object
from launcher.data_check import check_data_or_exit
from launcher.distributed import in_distributed_launch, launch_local_world
from launcher.plan import plan_or_exit


def build_data(cfg, plan, run_dir: Path, consumed_samples: int):
    """(next_batch, eval_batches) for this rank (collective: datasets are built on all ranks)."""
    from megatron.core import parallel_state

    from launcher.data import build_datasets, make_loader, split_sizes

    t, dp_size = cfg.trainer, plan.data_parallel_size
    dp_rank = parallel_state.get_data_parallel_rank()
    eval_samples = t.eval_iters * t.micro_batch_size * dp_size
    train, valid, _ = build_datasets(
        cfg.data, seq_length=cfg.model.seq_length, vocab_size=cfg.model.vocab_size,
        seed=t.seed, cache_dir=cfg.data.cache_dir or str(run_dir / "cache"),
        sizes=split_sizes(train_samples=plan.train_steps * plan.global_batch_size,
                          eval_samples=eval_samples))
    common = dict(micro_batch_size=t.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    iterator = iter(make_loader(train, consumed_samples=consumed_samples,
                                num_workers=cfg.data.num_workers,
                                total_samples=plan.train_steps * plan.global_batch_size, **common))

    def eval_batches():
        loader = make_loader(valid, consumed_samples=0, num_workers=0,
                             total_samples=eval_samples, **common)
        return itertools.islice(loader, t.eval_iters)
    return (lambda: next(iterator)), (eval_batches if valid is not None and t.eval_interval
                                      else None)


def plan_for_attention_kernel(cfg, plan, world: int):
    """(cfg, plan, note): re-planned with unfused attention when the plan counted flash attention
    that this machine cannot run (no Transformer Engine); exit 2 when the explicitly asked-for
    kernel is unavailable or the re-plan no longer fits."""
    import dataclasses

    from launcher.model import KernelUnavailable, runnable_attention
    from launcher.plan import PlanError, compute_plan, print_problems

    try:
        trainer, note = runnable_attention(cfg.trainer, planned_flash=plan.flash_attention)
    except KernelUnavailable as exc:
        print(f"train: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    if note is None:
        return cfg, plan, None
    cfg = dataclasses.replace(cfg, trainer=trainer)
    try:
        return cfg, compute_plan(cfg, world), note
    except PlanError as exc:
        print(f"train: {note}", file=sys.stderr)
        print_problems(exc)
        raise SystemExit(CONFIG_ERROR_EXIT) from None


def build_engine_for_run(cfg, plan, run_dir: Path, rank: int):
    """The engine of ``cfg.engine.name``; under DeepSpeed rank 0 writes the generated
    ds_config.json into the run dir."""
    from launcher.atomic import atomic_write_json
    from launcher.config import EngineName
    from launcher.engine import deepspeed_config
    from launcher.engines import build_engine_for

    ds_config = None
    if cfg.engine.name == EngineName.deepspeed:
        ds_config = deepspeed_config(plan, parallelism=cfg.parallelism, optimizer=cfg.optimizer,
                                     trainer=cfg.trainer, engine=cfg.engine)
        if rank == 0:
            atomic_write_json(run_dir / "ds_config.json", ds_config)
    return build_engine_for(cfg.engine.name, plan, model=cfg.model, parallelism=cfg.parallelism,
                            optimizer=cfg.optimizer, trainer=cfg.trainer, engine=cfg.engine,
                            ds_config=ds_config)


def write_pid_file(run_dir: Path, rank: int) -> None:
    """``run_dir/logs/rank_<r>.pid``: this rank's process id, so that an operator (or a test) can
    signal one rank, e.g. the early-warning stop signal."""
    from launcher.atomic import atomic_write_text

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "logs" / f"rank_{rank}.pid", f"{os.getpid()}\n")


def run_worker(argv: Sequence[str]) -> int:
    """Body of every training process; returns its exit code."""
    import torch

    from launcher import checkpoint
    from launcher.distributed import destroy_distributed, init_distributed
    from launcher.loop import LoopState, TrainLoop, TrainingAborted
    from launcher.metrics import make_metrics_logger
    from launcher.model import init_parallel_state
    from launcher.rundir import prepare_run_dir, run_dir_path, to_plain
    from launcher.signals import StopRequest
    from launcher.timers import PhaseTimer

    raw = compose_or_exit(argv)
    cfg = to_object(raw)
    stop = StopRequest(cfg.trainer.stop_signal)
    rank, _, world = init_distributed()
    cfg, plan, attention_note = plan_for_attention_kernel(cfg, plan_or_exit(cfg, world), world)
    init_parallel_state(cfg.parallelism, seed=cfg.trainer.seed)
    run_dir = run_dir_path(cfg.run, cfg.model.name, cfg.cluster.name)
    config = to_plain(raw)
    if rank == 0:
        prepare_run_dir(run_dir, config=config, plan=plan)
    torch.distributed.barrier()
    write_pid_file(run_dir, rank)
    metrics = make_metrics_logger(rank, run_dir=run_dir, logger=cfg.logger,
                                  run_name=run_dir.name, config=config)
    if attention_note:
        metrics.log_event("attention", attention_note)
    try:
        resume = checkpoint.find_resume(run_dir, cfg.trainer.load)
        engine = build_engine_for_run(cfg, plan, run_dir, rank)
        state = LoopState()
        if resume is not None:
            checkpoint.load(engine.checkpoint_io, resume)
            state = LoopState(step=resume.step, consumed_samples=resume.consumed_samples,
                              last_saved=resume.step)
            metrics.log_event("resume", f"resumed from {resume.path} at step {resume.step}")
        next_batch, eval_batches = build_data(cfg, plan, run_dir, state.consumed_samples)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else None
        loop = TrainLoop(engine=engine, plan=plan, trainer=cfg.trainer, optimizer=cfg.optimizer,
                         next_batch=next_batch, eval_batches=eval_batches, metrics=metrics,
                         timer=PhaseTimer(sync=sync), stop=stop,
                         checkpoints_dir=run_dir / "checkpoints", state=state,
                         saved_extras={"config": config, "plan": plan.to_dict()})
        return loop.run()
    except (TrainingAborted, checkpoint.CheckpointError) as exc:
        metrics.log_event("abort", str(exc))
        print(f"train: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return getattr(exc, "exit_code", 1)
    finally:
        metrics.close()
        stop.restore()
        destroy_distributed()


def _worker_entry(argv: list) -> None:
    """Module-level (picklable) entry of spawned workers: exit with the worker's code."""
    code = run_worker(argv)
    if code:
        raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(flag in argv for flag in ("-m", "--multirun")):
        from launcher.sweep import main as sweep_main  # Hydra multirun: one run per point
        return sweep_main(argv)
    cfg = to_object(compose_or_exit(argv))
    plan = plan_or_exit(cfg)
    check_data_or_exit(cfg.data.prefixes, cfg.model.vocab_size)
    nprocs = cfg.cluster.gpus_per_node
    if in_distributed_launch() or (cfg.cluster.nodes == 1 and nprocs == 1):
        return run_worker(argv)
    if cfg.cluster.nodes > 1:
        print(f"train: cluster.nodes={cfg.cluster.nodes} needs a multi-node launcher (srun or "
              f"torchrun); this process only starts workers on one machine", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    del plan  # checked here; every worker recomputes it for its world size
    launch_local_world(_worker_entry, (argv,), nprocs, run_id=f"tw-{uuid.uuid4().hex[:8]}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
