"""A job, composed and planned once, in the process that launches it: :func:`prepare`.

Every command that runs on ranks (``launcher.train``, ``launcher.convert from_hf``,
``launcher.generate``) turns its command line into one :class:`Job` before any rank exists:
compose (the weights' model adopted when the command starts from weights; exit 2 on a config
error), plan for the world the ranks will form (exit 2 on a plan problem), re-plan with the
kernels this machine really runs. :mod:`launcher.launch.bootstrap` hands the same Job to every
rank it starts, so no rank composes or plans again.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from launcher.cli.probe_first import needs_probe, probe_first
from launcher.compose import compose_or_exit, config_errors, exit_on_config_error, to_object
from launcher.config import Precision, TrainwrightConfig
from launcher.core import objectstore
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.evals.check import check_eval_or_exit
from launcher.launch.contamination import with_contamination
from launcher.launch.model_source import adopt_model
from launcher.parallel.distributed import in_distributed_launch
from launcher.plan import Plan, PlanError, compute_plan, plan_or_exit, print_problems
from launcher.plan.data_check import check_data_or_exit, shard_cache
from launcher.plan.validate import check_interleaving
from launcher.plan.precision import resolve_precision, with_precision
from launcher.runtime.rundir import run_dir_path, to_plain
from launcher.runtime.startup import process_start_time
from launcher.shape import cluster_world_size


@dataclass(frozen=True)
class Job:
    """What every rank of a command starts from."""

    argv: tuple[str, ...]
    """The overrides the config was composed from (with the weights' model, when adopted)."""
    config: dict
    """The resolved config as plain values (what config.yaml and checkpoints record)."""
    cfg: TrainwrightConfig
    """The typed config (with the attention kernels this machine runs)."""
    plan: Optional[Plan]
    """The plan for the world the ranks form; None for a command that trains nothing."""
    run_dir: Optional[Path]
    """Where the ranks write their logs, pid files and checkpoints; None: nowhere (their
    library output stays on the console)."""
    notes: tuple[str, ...] = ()
    """Events worth logging once the run's metrics exist (e.g. a re-plan for the kernels)."""
    launched_at: float = 0.0
    """When the process that prepared the job started (epoch seconds): where every rank's
    start-up clock (:mod:`launcher.runtime.startup`) counts from; 0 = each rank's own start."""

    @property
    def local_ranks(self) -> int:
        """Training processes on each machine: GPUs per node x ranks per GPU."""
        return self.cfg.cluster.gpus_per_node * self.cfg.cluster.ranks_per_gpu


def launched_world(cfg: TrainwrightConfig) -> int:
    """The world the ranks will form: the launcher's (torchrun's WORLD_SIZE, srun's
    SLURM_NTASKS) when this process is one of them, else the cluster's."""
    if in_distributed_launch():
        return int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])
    return cluster_world_size(cfg.cluster)


def compose(argv: Sequence[str], weights_key: str = "") -> tuple[list[str], DictConfig]:
    """(the overrides, the composed config), with the model of the weights that ``weights_key``
    names (``trainer.init_from``) adopted; exit 2 on a config error or a model mismatch."""
    argv = list(argv)
    raw = compose_or_exit(argv)
    weights = str(OmegaConf.select(raw, weights_key) or "") if weights_key else ""
    if weights:
        argv = adopt_model(argv, weights_key, weights)
        raw = compose_or_exit(argv)
    return argv, raw


def prepare(argv: Sequence[str], *, weights_key: str = "", plan: bool = True,
            run_dir: Optional[Path] = None) -> Job:
    """The job of ``argv``: composed, planned (unless ``plan`` is False) and checked against its
    data; ``run_dir`` replaces the config's run directory (None: the config's, when planned)."""
    argv, raw = compose(argv, weights_key)
    if not plan:
        job = Job(tuple(argv), to_plain(raw), resolve_precision(to_object(raw)), None, run_dir)
    else:
        job = planned_job(argv, raw, run_dir=run_dir)
    return dataclasses.replace(job, launched_at=process_start_time())


def planned_job(argv: Sequence[str], raw: DictConfig, *, run_dir: Optional[Path] = None,
                check_data: bool = True) -> Job:
    """The job of the composed ``raw``: planned for the world the ranks will form (exit 2 on a
    plan problem) and, with ``check_data``, checked against its data shards."""
    cfg = to_object(raw)
    if check_data:
        cfg = with_contamination(with_eval_rows(cfg))  # exit 2 on a task problem, first
    world = launched_world(cfg)
    plan = trainable_or_exit(plan_or_exit(cfg, world))
    if needs_probe(cfg.plan.calibrate, plan.sources["step time"]) and not in_distributed_launch():
        plan = calibrated_plan(argv, cfg, world)
    cfg = with_precision(cfg, Precision(plan.precision))  # trainer.precision=auto, resolved
    cfg = dataclasses.replace(cfg, resilience=dataclasses.replace(
        cfg.resilience, first_phase_timeout_s=plan.first_phase_timeout_s))  # 0: the plan's
    cfg, planned, notes = plan_for_this_machine(cfg, plan, world)
    if check_data:
        check_data_or_exit(cfg.data.prefixes, cfg.model.vocab_size, cfg.data.split,
                           cache=shard_cache(cfg.data))
        check_stores_or_exit(cfg.trainer)
    run_dir = run_dir or run_dir_path(cfg.run, cfg.model.name, cfg.cluster.name)
    config = to_plain(raw)
    config["trainer"]["precision"] = plan.precision  # what config.yaml records: the one trained
    config["eval"].update(rows=cfg.eval.rows, tokens=cfg.eval.tokens,
                          contaminated=dict(cfg.eval.contaminated))
    notes = (f"precision {plan.precision}: {plan.precision_reason}",) + notes \
        if raw.trainer.precision == "auto" else notes
    return Job(tuple(argv), config, cfg, planned, run_dir, notes)


def check_stores_or_exit(trainer) -> None:
    """Exit 2, before any rank starts, when trainer.checkpoint_uri or trainer.load names an
    object store this process cannot use (credentials, bucket, endpoint), naming the key."""
    for key, value, write in (("trainer.checkpoint_uri", trainer.checkpoint_uri, True),
                              ("trainer.load", trainer.load, False)):
        if not objectstore.is_remote(value):
            continue
        try:
            objectstore.check_usable(objectstore.ObjectURI.parse(value), write=write)
        except objectstore.StoreUnusable as exc:
            print(f"error: {key}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(CONFIG_ERROR_EXIT) from None


def trainable_or_exit(plan: Plan) -> Plan:
    """``plan``, or exit 2 on what the plan only warns about but no step survives: an
    interleaved pipeline with fewer micro-batches per step than stages, or a remainder
    (Megatron-Core's schedule raises at the first step, after the whole start-up)."""
    refused = check_interleaving(plan.dims, plan.batch.grad_accum_steps)
    if refused:
        print_problems(PlanError(refused, plan))
        raise SystemExit(CONFIG_ERROR_EXIT)
    return plan


def with_eval_rows(cfg: TrainwrightConfig) -> TrainwrightConfig:
    """``cfg`` with ``eval.rows`` and ``eval.tokens`` counted from its tasks (checked first:
    exit 2 on a problem)."""
    if not cfg.eval.tasks:
        return cfg
    check_eval_or_exit(cfg)
    if cfg.eval.rows:
        return cfg
    from launcher.evals.count import count_rows
    from launcher.evals.rows import packing_of
    from launcher.evals.tokenizer import eval_tokenizer_path

    packing = packing_of(cfg.eval, cfg.model, cp=cfg.parallelism.context_parallel_size,
                         te=str(cfg.cluster.gpu).lower() != "cpu")
    rows, tokens = count_rows(cfg.eval, eval_tokenizer_path(cfg.eval, cfg.data),
                              cfg.model.seq_length, micro_batch=cfg.trainer.micro_batch_size,
                              packing=packing)
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, rows=rows, tokens=tokens))


def calibrated_plan(argv: Sequence[str], cfg: TrainwrightConfig, world: int) -> Plan:
    """``plan.calibrate=true`` and nothing measured this job here: run the machine probe with the
    same overrides (its own run directory), then plan again."""
    probe_first(argv, cfg.run.name, "plan")
    return plan_or_exit(cfg, world)


TRAINING_GROUPS = ("model", "parallelism", "data", "optimizer", "trainer", "engine")
"""The groups a checkpoint's saved config fixes for a command that continues its state (the
others, e.g. cluster and logger, are the command line's)."""


def with_saved_training(raw: DictConfig, saved: dict,
                        changes: Optional[dict] = None) -> DictConfig:
    """``raw`` (composed from a command line) with the training groups of a checkpoint's saved,
    resolved config, then ``changes`` (a nested dict) on top; exit 2 naming the key when the
    saved config no longer fits the schema."""
    with exit_on_config_error(), config_errors():
        merged = OmegaConf.merge(raw, {k: saved[k] for k in TRAINING_GROUPS if k in saved},
                                 changes or {})
        OmegaConf.resolve(merged)
    return merged


def plan_for_this_machine(cfg: TrainwrightConfig, plan: Plan,
                          world: int) -> tuple[TrainwrightConfig, Plan, tuple[str, ...]]:
    """(cfg, plan, notes): re-planned with the kernels this machine runs when the plan counted
    Transformer Engine's (flash attention, TE's fused loss) and TE is not importable; exit 2
    when an explicitly asked-for kernel is unavailable (FP8 included: no TE, an older GPU) or
    the re-plan no longer fits."""
    from launcher.engines.model import (KernelUnavailable, context_parallel_unavailable,
                                        runnable_attention)

    try:
        trainer, note = runnable_attention(cfg.trainer, planned_flash=plan.memory.flash_attention)
        refused = context_parallel_unavailable(cfg.parallelism)
        if refused is not None:
            raise KernelUnavailable(refused)
    except KernelUnavailable as exc:
        print(f"train: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    if trainer == cfg.trainer:
        return cfg, plan, ()
    cfg = dataclasses.replace(cfg, trainer=trainer)
    try:
        return cfg, compute_plan(cfg, world), (note,) if note else ()
    except PlanError as exc:
        if note:
            print(f"train: {note}", file=sys.stderr)
        print_problems(exc)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
