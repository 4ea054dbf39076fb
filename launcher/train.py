"""``python -m launcher.train [overrides]``: train the configured model.

parse and plan once, here (:func:`launcher.launch.job.prepare`: exit 2 on a config or plan
error) -> start the ranks (:func:`launcher.launch.bootstrap.run_ranks`) -> on every rank: lock the
run directory, resume, build the engine (from the registry) and the data, train
(:class:`launcher.runtime.loop.TrainLoop`), close. Exit codes (:mod:`launcher.core.exits`): 0
done, 2 config error, 3 non-finite loss/gradient, 75 stopped for requeue, 1 other.
"""

from __future__ import annotations

RANK_MODULES = ("megatron.core.models.gpt", "launcher.train", "launcher.engines.megatron",
                "launcher.runtime.loop", "launcher.runtime.data", "launcher.runtime.checkpoint",
                "launcher.runtime.session", "launcher.runtime.evaluation", "torch._dynamo")
"""What a training rank imports, imported for it before it starts
(:func:`launcher.launch.rank_preload.preload_rank_imports`; ``torch._dynamo``: see there);
DeepSpeed is imported by the ranks that use it."""

if __name__ in ("__main__", "__mp_main__"):  # before anything slow: no stop is lost from here
    import sys as _sys

    from launcher.core.exits import REQUEUE_EXIT as _STOPPED
    from launcher.core.stop import stop_from_first_line
    from launcher.parallel.distributed import launch_rank as _launch_rank

    if not {"-m", "--multirun"} & set(_sys.argv[1:]):  # a sweep: each point's run does this
        stop_from_first_line(_STOPPED, "train", __name__, announce=_launch_rank() == 0)
        if __name__ == "__main__" and not any(a.startswith("-") for a in _sys.argv[1:]):
            from launcher.launch.rank_preload import preload_rank_imports as _preload

            _preload(RANK_MODULES)  # the ranks' imports, on another core while this one plans

import contextlib
import os
import sys
from typing import Sequence

from launcher.core.diskspace import free_space_text
from launcher.core.errors import CheckpointError, TrainingAborted
from launcher.core.exits import CONFIG_ERROR_EXIT, REQUEUE_EXIT
from launcher.launch.agent import scheduler_exit
from launcher.launch.bootstrap import Rank, run_ranks
from launcher.launch.job import prepare
from launcher.launch.rank_preload import preload_rank_imports
from launcher.launch.remote_inputs import localized
from launcher.runtime.goodput import print_summary
from launcher.runtime.metrics import Metrics


def main(argv: Sequence[str] | None = None) -> int:
    from launcher.cli import handle_flags  # --help, --cfg, --info, ...: print and exit
    from launcher.runtime.session import run_dir_free

    argv = handle_flags(sys.argv[1:] if argv is None else argv, "launcher.train", __doc__, True)
    if any(flag in argv for flag in ("-m", "--multirun")):
        from launcher.launch.sweep import main as sweep_main  # Hydra multirun: one run per point
        return sweep_main(argv, on_end=finish_sweep)
    preload_rank_imports(RANK_MODULES)
    job = prepare(localized(argv, ("trainer.init_from",)), weights_key="trainer.init_from")
    if not run_dir_free(job.run_dir):
        return CONFIG_ERROR_EXIT
    code: int | None = 1
    try:
        code = run_ranks(job, train, command="train", resilient=True)
        return code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        finish_run(job.run_dir, code, report=job.cfg.run.report, launched_at=job.launched_at)


def finish_sweep(sweep_dir) -> None:
    """However a sweep ended: its HTML report in the sweep directory (one line if it cannot
    be written)."""
    from launcher.reports.sweep import points, write_sweep_report

    try:
        if points(sweep_dir):
            print(f"[report] {write_sweep_report(sweep_dir)}", file=sys.stderr, flush=True)
    except Exception as exc:  # a report is never worth failing a sweep for
        print(f"[report] not written: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def finish_run(run_dir, code: int | None, *, report: bool, launched_at: float = 0.0) -> None:
    """However a run ended: its ``run_end`` event, the goodput line and (``run.report``) its
    HTML report, by the launching process only; a run that finished or stopped also records the
    plan against the steps this launch (since ``launched_at``) ran, and says so last when the plan
    was more than 15% off. A report that cannot be written is one line; it never changes the
    run's exit code."""
    from launcher.parallel.distributed import launch_rank
    from launcher.reports.data import record_end
    from launcher.reports.run import write_run_report

    if launch_rank() != 0 or not (run_dir / "metrics.jsonl").exists():
        return
    try:
        off = record_plan_check(run_dir, launched_at) if code in (0, REQUEUE_EXIT) else ""
        record_end(run_dir, code)
        print_summary(run_dir)
        if report:
            print(f"[report] {write_run_report(run_dir)}", file=sys.stderr, flush=True)
        if off:
            print(f"[plan] off by more than 15%: {off}", file=sys.stderr, flush=True)
    except Exception as exc:  # e.g. a full disk: never worth hiding how the run ended
        print(f"[report] the run's end, goodput line and report not written: "
              f"{type(exc).__name__}: {exc} ({free_space_text(run_dir)} under {run_dir})",
              file=sys.stderr, flush=True)


def record_plan_check(run_dir, since: float) -> str:
    """The ``plan_check`` event (the plan against the steps launched since ``since``); the
    figures more than 15% off, as one line ('' when none is)."""
    from launcher.reports.plan_check import off_figures, plan_check, summary
    from launcher.runtime.metrics import append_event

    comparisons = plan_check(run_dir, since)
    if not comparisons:
        return ""
    append_event(run_dir, "plan_check", summary(comparisons),
                 **{f"{c.name}/{k}": getattr(c, k) for c in comparisons
                    for k in ("planned", "measured")})
    return summary(off_figures(comparisons))


def train(rank: Rank) -> int:
    """One rank of the run, from the locked run directory to the loop's exit code."""
    from launcher.runtime.data import data_failure
    from launcher.runtime.session import run_session

    job = rank.job
    with run_session(job.run_dir, rank=rank.rank, console=rank.console, logger=job.cfg.logger,
                     config=job.config, plan=job.plan, notes=job.notes) as metrics:
        if metrics is None:  # a live run holds the directory
            return CONFIG_ERROR_EXIT
        rank.clock.mark("run_directory")
        try:
            return resume_build_train(rank, metrics)
        except (TrainingAborted, CheckpointError) as exc:
            return aborted(rank, metrics, exc)
        except Exception as exc:  # a shard gone bad under the run ends it (exit 3), else raise
            return aborted(rank, metrics, data_failure(job.cfg.data.prefixes, exc))


def aborted(rank: Rank, metrics: Metrics, exc: TrainingAborted | CheckpointError) -> int:
    """One console line and an event for a run that cannot go on; its exit code, decided
    before anything is written (the event may not be: its disk may be the one that is full)."""
    code = rank.decide(exc.exit_code)
    rank.console.error(f"train: rank {rank.rank}: {exc}")
    with contextlib.suppress(OSError):
        metrics.log_event("abort", str(exc), echo=False)
    return code


def resume_build_train(rank: Rank, metrics: Metrics) -> int:
    """Resume (refused before anything is built when the checkpoint does not fit), build the
    engine, its checkpoint manager and the data, then train."""
    import torch

    from launcher.core.phases import PhaseTimer
    from launcher.engines import engine_inputs, spec
    from launcher.runtime import resume as resume_safety
    from launcher.runtime.checkpoint import CheckpointManager
    from launcher.runtime.checkpoint_store import locate_resume, uploads_to
    from launcher.runtime.data import build_data
    from launcher.launch.eval_jobs import dispatcher
    from launcher.runtime.eval_jobs import make_eval_jobs
    from launcher.runtime.evaluation import build_downstream, rank_packing
    from launcher.runtime.loop import TrainLoop
    from launcher.runtime.rundir import redact
    from launcher.runtime.session import initial_weights

    job, plan = rank.job, rank.job.plan
    retry_s = store_retry_s(job.cfg.trainer, plan)
    resume = locate_resume(job.run_dir, job.cfg.trainer.load, job.cfg.trainer.checkpoint_uri,
                           retry_s)
    record = resume_safety.run_record(job.cfg, plan)
    resume_safety.refuse_incompatible(resume, record)  # exit 2 before anything is built
    if resume_safety.already_trained(resume, plan.batch.train_steps, metrics):
        return 0
    cfg = initial_weights(job.cfg, resume, metrics)
    engine_spec, subs = spec(cfg.engine.name), engine_inputs(cfg)
    engine = engine_spec.build(batch=plan.batch, model=cfg.model, **subs)
    rank.clock.mark("build")
    eval_jobs = make_eval_jobs(rank.rank, run_dir=job.run_dir, metrics=metrics,
                               asynchronous=cfg.eval.asynchronous and bool(cfg.eval.tasks),
                               seq_length=cfg.model.seq_length,
                               dispatch=dispatcher(cfg, plan, job.run_dir))
    checkpoints = CheckpointManager(
        job.run_dir / "checkpoints", engine.checkpoint_io, keep_last=cfg.trainer.keep_last,
        async_save=cfg.trainer.async_save, final_step=plan.batch.train_steps, record=record,
        report=metrics.log_event, on_complete=eval_jobs.saved,
        store=uploads_to(cfg.trainer.checkpoint_uri, retry_s),
        failures_allowed=cfg.trainer.checkpoint_failures_allowed)
    state = resume_safety.resume_state(checkpoints, resume, record, metrics, cfg.optimizer)
    resume_safety.started(job.run_dir, config=job.config, plan=plan,
                          files=engine_spec.run_files(batch=plan.batch, **subs))
    rank.clock.mark("checkpoint")
    next_batch, eval_batches = build_data(cfg, plan, job.run_dir, state.consumed_samples)
    downstream = None if cfg.eval.asynchronous else build_downstream(
        engine, ev=cfg.eval, data=cfg.data, seq=cfg.model.seq_length,
        micro_batch=plan.batch.micro_batch_size, packing=rank_packing(cfg))
    eval_jobs.catch_up()
    rank.clock.mark("data")
    metrics.log_event("startup", rank.clock.text(),
                      **{f"{k}_s": round(v, 3) for k, v in rank.clock.parts().items()})
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    beat = rank.heartbeat.phase if rank.heartbeat is not None else None
    rank.started()
    return TrainLoop(engine=engine, plan=plan, trainer=cfg.trainer, optimizer=cfg.optimizer,
                     next_batch=next_batch, eval_batches=eval_batches,
                     downstream=downstream, metrics=metrics,
                     timer=PhaseTimer(sync=sync, on_phase=beat), stop=rank.stop,
                     checkpoints=checkpoints, state=state, heartbeat=rank.heartbeat,
                     eval_jobs=eval_jobs,
                     saved_extras={"config": redact(job.config), "plan": plan.to_dict()}).run()


def store_retry_s(trainer, plan) -> float:
    """Seconds an object store's transfers keep retrying: trainer.checkpoint_retry_s, or twice
    the planned save time, at least 30 s, and at most half the hang watchdog's allowance for a
    first save (a final save waits for its upload; the watchdog must not kill it first)."""
    planned = plan.goodput.save_s if plan.goodput is not None else 0.0
    cap = plan.first_phase_timeout_s / 2 if plan.first_phase_timeout_s > 0 else float("inf")
    return trainer.checkpoint_retry_s or min(max(30.0, 2.0 * planned), cap)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(scheduler_exit(main))
