"""``python -m launcher.train [overrides]``: train the configured model.

compose (exit 2 on config errors) -> plan (exit 2 on plan problems) -> start one process per
local GPU (times ``cluster.ranks_per_gpu``) when not already launched -> in each: library shims,
process groups, run directory, engine (from the registry), resume, data ->
:class:`launcher.runtime.loop.TrainLoop` -> close. Exit codes: 0 done, 2 config error,
3 non-finite loss/gradient (launcher.runtime.loop), 75 stopped for requeue
(launcher.core.stop), 1 other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

from launcher.compose import compose_or_exit, to_object
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.launch.local import launch_local_world
from launcher.parallel.distributed import in_distributed_launch
from launcher.plan import plan_or_exit
from launcher.plan.data_check import check_data_or_exit
from launcher.runtime.console import library_logs_to


def plan_for_attention_kernel(cfg, plan, world: int):
    """(cfg, plan, note): re-planned with the kernels this machine runs when the plan counted
    Transformer Engine's (flash attention, TE's fused loss) and TE is not importable; exit 2
    when an explicitly asked-for kernel is unavailable (FP8 included: no TE, an older GPU) or
    the re-plan no longer fits."""
    import dataclasses

    from launcher.engines.model import KernelUnavailable, runnable_attention
    from launcher.plan import PlanError, compute_plan, print_problems

    try:
        trainer, note = runnable_attention(cfg.trainer, planned_flash=plan.flash_attention)
    except KernelUnavailable as exc:
        print(f"train: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    if trainer == cfg.trainer:
        return cfg, plan, None
    cfg = dataclasses.replace(cfg, trainer=trainer)
    try:
        return cfg, compute_plan(cfg, world), note
    except PlanError as exc:
        if note:
            print(f"train: {note}", file=sys.stderr)
        print_problems(exc)
        raise SystemExit(CONFIG_ERROR_EXIT) from None


def write_pid_file(run_dir: Path, rank: int) -> None:
    """``run_dir/logs/rank_<r>.pid``: this rank's process id, so that an operator (or a test) can
    signal one rank, e.g. the early-warning stop signal."""
    from launcher.core.atomic import atomic_write_text

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "logs" / f"rank_{rank}.pid", f"{os.getpid()}\n")


class Worker(NamedTuple):
    """A training process after start-up: configs, plan, stop request, rank, where it writes."""

    raw: Any
    cfg: Any
    plan: Any
    stop: Any
    attention_note: Optional[str]
    rank: int
    run_dir: Path
    console: Any


def start_worker(argv: Sequence[str]) -> Worker:
    """Compose, send library output to the rank's log (unless run.verbose), patch the libraries,
    join the process groups and plan for this world."""
    from launcher.engines import compat
    from launcher.engines.model import init_parallel_state
    from launcher.runtime import strict_devices
    from launcher.runtime.console import route_output
    from launcher.parallel.distributed import init_distributed, launch_rank
    from launcher.runtime.rundir import run_dir_path
    from launcher.core.stop import StopRequest
    from launcher.parallel import collectives

    raw = compose_or_exit(argv)
    cfg = to_object(raw)
    run_dir = run_dir_path(cfg.run, cfg.model.name, cfg.cluster.name)
    console = route_output(run_dir, launch_rank(), cfg.run.verbose)
    stop = StopRequest(cfg.trainer.stop_signal, any_rank=collectives.any_rank)
    compat.install()
    strict_devices.install_if_requested()
    rank, _, world = init_distributed(ranks_per_gpu=cfg.cluster.ranks_per_gpu)
    with contextlib.redirect_stderr(console.err):  # plan problems are for the operator
        cfg, plan, note = plan_for_attention_kernel(cfg, plan_or_exit(cfg, world), world)
    init_parallel_state(cfg.parallelism, seed=cfg.trainer.seed)
    return Worker(raw, cfg, plan, stop, note, rank, run_dir, console)


def run_worker(argv: Sequence[str]) -> int:
    """Body of every training process: parse -> plan -> build -> train -> close; its exit code.
    A crash is reported on the console with its traceback (library output is in the rank log)."""
    from launcher.runtime.console import report_crash

    worker = start_worker(argv)
    try:
        return train_worker(worker)
    except Exception as exc:
        report_crash(worker.console, worker.rank, exc)
        raise


def train_worker(w: Worker) -> int:
    """Lock the run directory, then resume, build, train and close; the exit code."""
    import torch

    from launcher.engines import spec
    from launcher.core import locks
    from launcher.parallel import collectives
    from launcher.core import checkpoints as layout
    from launcher.core.errors import CheckpointError
    from launcher.runtime import checkpoint
    from launcher.runtime import resume as resume_safety
    from launcher.runtime.data import build_data
    from launcher.parallel.distributed import destroy_distributed
    from launcher.core.errors import TrainingAborted
    from launcher.runtime.loop import TrainLoop
    from launcher.runtime.rundir import redact, to_plain
    from launcher.core.phases import PhaseTimer

    cfg, plan, stop, rank, run_dir = w.cfg, w.plan, w.stop, w.rank, w.run_dir
    config = to_plain(w.raw)
    locked, stale = take_run_lock(run_dir, rank, w.console)
    if not locked:
        destroy_distributed()
        return CONFIG_ERROR_EXIT
    metrics = open_metrics(w, config, stale)
    collectives.barrier()
    write_pid_file(run_dir, rank)
    if w.attention_note:
        metrics.log_event("attention", w.attention_note)
    try:
        resume = layout.find_resume(run_dir, cfg.trainer.load)
        record = resume_safety.run_record(cfg, plan)
        resume_safety.refuse_incompatible(resume, record)  # exit 2 before anything is built
        if resume_safety.already_trained(resume, plan, metrics):
            return 0
        cfg = initial_weights(cfg, resume, metrics)
        engine_spec, subs = spec(cfg.engine.name), _engine_configs(cfg)
        engine = engine_spec.build(plan, model=cfg.model, **subs)
        checkpoints = checkpoint.CheckpointManager(
            run_dir / "checkpoints", engine.checkpoint_io, keep_last=cfg.trainer.keep_last,
            async_save=cfg.trainer.async_save, final_step=plan.train_steps, record=record,
            report=metrics.log_event)
        state = resume_safety.resume_state(checkpoints, resume, record, metrics, cfg.optimizer)
        resume_safety.started(run_dir, config=config, plan=plan,
                              files=engine_spec.run_files(plan, **subs))
        next_batch, eval_batches = build_data(cfg, plan, run_dir, state.consumed_samples)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else None
        return TrainLoop(engine=engine, plan=plan, trainer=cfg.trainer, optimizer=cfg.optimizer,
                         next_batch=next_batch, eval_batches=eval_batches, metrics=metrics,
                         timer=PhaseTimer(sync=sync), stop=stop, checkpoints=checkpoints,
                         state=state,
                         saved_extras={"config": redact(config), "plan": plan.to_dict()},
                         ).run()
    except (TrainingAborted, CheckpointError) as exc:
        metrics.log_event("abort", str(exc))
        w.console.error(f"train: rank {rank}: {exc}")
        return getattr(exc, "exit_code", 1)
    finally:
        metrics.close()
        if not stop.decided:  # a stopping rank keeps ignoring stop signals until it has exited
            stop.restore()
        locks.release(run_dir)
        destroy_distributed()


def open_metrics(w: Worker, config: dict, stale):
    """The run's metrics logger (a no-op off rank 0), with the first events: a stale lock taken
    over (``stale``: its dead holder, or None) and where the library output goes."""
    from launcher.runtime.metrics import make_metrics_logger

    metrics = make_metrics_logger(w.rank, run_dir=w.run_dir, logger=w.cfg.logger, config=config,
                                  plan=w.plan, run_name=w.run_dir.name, console=w.console.out)
    if stale is not None:
        metrics.log_event("lock", f"took over the lock of pid {stale.pid} on {stale.host}, which "
                          "is no longer running")
    if w.console.log is not None:
        metrics.log_event("logs", f"library output of each rank: {w.run_dir / 'logs'}/rank_<r>.log "
                          "(run.verbose=true shows it here)")
    return metrics


def initial_weights(cfg, resume, metrics):
    """``cfg`` with ``trainer.init_from`` cleared when the run resumes from its own checkpoint
    (its trained weights win); the choice is logged."""
    import dataclasses

    if not cfg.trainer.init_from:
        return cfg
    if resume is not None:
        metrics.log_event("init_from", f"ignored trainer.init_from={cfg.trainer.init_from}: "
                          f"resuming from {resume.path}")
        return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, init_from=""))
    metrics.log_event("init_from", f"weights from {cfg.trainer.init_from} (optimizer fresh, "
                      "step 0)")
    return cfg


def take_run_lock(run_dir: Path, rank: int, console):
    """Rank 0 locks the run directory (collective): (every rank may go on, the dead holder whose
    lock was taken over or None). A live holder is printed and every rank stops."""
    from launcher.core import locks
    from launcher.parallel import collectives

    stale, refused = None, False
    if rank == 0:
        try:
            stale = locks.acquire(run_dir)
        except locks.RunLocked as exc:
            console.error(f"train: {exc}")
            refused = True
    return not collectives.any_rank(refused), stale


def _engine_configs(cfg) -> dict:
    """The narrow sub-configs an engine is built from (keyword arguments of its spec)."""
    return dict(parallelism=cfg.parallelism, optimizer=cfg.optimizer, trainer=cfg.trainer,
                engine=cfg.engine)


def run_dir_free(cfg) -> bool:
    """Before spawning anything: False (and why, on stderr) when a live run holds the run
    directory (rank 0 takes the lock itself; this only fails early)."""
    from launcher.core import locks
    from launcher.runtime.rundir import run_dir_path

    try:
        locks.check_free(run_dir_path(cfg.run, cfg.model.name, cfg.cluster.name))
    except locks.RunLocked as exc:
        print(f"train: {exc}", file=sys.stderr, flush=True)
        return False
    return True


def launcher_log_path(cfg) -> Path:
    """``<run_dir>/logs/launcher.log``: torch elastic's records of this launcher process."""
    from launcher.runtime.rundir import run_dir_path

    return run_dir_path(cfg.run, cfg.model.name, cfg.cluster.name) / "logs" / "launcher.log"


def _worker_entry(argv: list) -> None:
    """Module-level (picklable) entry of spawned workers: exit with the worker's code."""
    code = run_worker(argv)
    if code:
        raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    from launcher.cli import handle_flags  # --help, --cfg, --info, ...: print and exit
    argv = handle_flags(sys.argv[1:] if argv is None else argv, "launcher.train", __doc__, True)
    if any(flag in argv for flag in ("-m", "--multirun")):
        from launcher.launch.sweep import main as sweep_main  # Hydra multirun: one run per point
        return sweep_main(argv)
    cfg = to_object(compose_or_exit(argv))
    if cfg.trainer.init_from:  # the weights' model, or exit 2 on a mismatch
        from launcher.convert.model_source import adopt_model
        argv = adopt_model(argv, "trainer.init_from", cfg.trainer.init_from)
        cfg = to_object(compose_or_exit(argv))
    plan = plan_or_exit(cfg)
    check_data_or_exit(cfg.data.prefixes, cfg.model.vocab_size)
    nprocs = cfg.cluster.gpus_per_node * cfg.cluster.ranks_per_gpu
    if in_distributed_launch() or (cfg.cluster.nodes == 1 and nprocs == 1):
        return run_worker(argv)
    if cfg.cluster.nodes > 1:
        print(f"train: cluster.nodes={cfg.cluster.nodes} needs a multi-node launcher (srun or "
              f"torchrun); this process only starts workers on one machine", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    plan_for_attention_kernel(cfg, plan, nprocs)  # kernels this machine lacks: exit 2 now
    del plan  # checked here; every worker recomputes it for its world size
    if not run_dir_free(cfg):
        return CONFIG_ERROR_EXIT
    with library_logs_to(None if cfg.run.verbose else launcher_log_path(cfg)):
        launch_local_world(_worker_entry, (argv,), nprocs, run_id=f"tw-{uuid.uuid4().hex[:8]}",
                           stop_signal=cfg.trainer.stop_signal)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
