"""Enumerate, check, fit and rank every layout of one composed config (:func:`search`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.config import TrainwrightConfig
from launcher.plan.calibrated import find_calibration
from launcher.plan.cpu_rates import plan_device
from launcher.plan.plan import PlanError, uses_flash
from launcher.plan.precision import with_precision
from launcher.plan.validate import Problem, check_positive, check_values
from launcher.search.evaluate import Scored, assess, engine_presets
from launcher.search.space import candidates, engine_names
from launcher.shape.dims import cluster_world_size


@dataclass(frozen=True)
class SearchResult:
    searched: int
    """Layouts enumerated."""
    valid: int
    """Of those, the ones the plan's checks accept and that fit in memory with the headroom."""
    ranked: list
    """Every valid layout (Scored), best predicted step time first."""
    global_batch: int
    """Sequences per step every candidate trains (the composed config's global batch)."""
    excluded: tuple = ()
    """With ``explain``: every dropped layout (Excluded), with its reason."""
    budget_bytes: float = 0.0
    """GPU memory a candidate may use (the GPU's, less search.headroom)."""
    step_time_source: str = "catalogue"
    """Where every candidate's step time comes from: "measured: <profile>" (a probe of this
    machine and model), "rates of this CPU's check (...)" (launcher/plan/cpu_rates.py) or
    "catalogue" (launcher/plan/hardware.py)."""


def global_batch_of(cfg: TrainwrightConfig, world: int) -> int:
    """The composed config's global batch in sequences (0 there: micro-batch x its DP)."""
    t, p = cfg.trainer, cfg.parallelism
    if t.global_batch_size:
        return t.global_batch_size
    model_parallel = p.tensor_parallel_size * p.pipeline_parallel_size * p.context_parallel_size
    return t.micro_batch_size * max(1, world // model_parallel)


def _base_problems(cfg: TrainwrightConfig) -> list[Problem]:
    """Checks that do not depend on the layout, made once (the search varies the rest)."""
    problems = check_values(cfg) + check_positive(cfg)
    if not 0 <= cfg.search.headroom < 1:
        problems.append(Problem(("search.headroom",), f"search.headroom={cfg.search.headroom} "
                                "must be in [0, 1), the share of GPU memory left free"))
    for key in ("top_k", "max_micro_batch_size", "max_tensor_parallel_nodes"):
        if getattr(cfg.search, key) < 1:
            problems.append(Problem((f"search.{key}",), f"search.{key}="
                                    f"{getattr(cfg.search, key)} must be >= 1"))
    if cfg.search.measure < 0:
        problems.append(Problem(("search.measure",), "search.measure must be >= 0"))
    return problems


def search(cfg: TrainwrightConfig, world: int | None = None,
           explain: bool = False) -> SearchResult:
    """Every layout, ranked by predicted step time; PlanError when the config itself is wrong.
    ``explain``: also keep every dropped layout with its reason (the HTML report's)."""
    problems = _base_problems(cfg)
    try:  # trainer.precision=auto and a CPU's rates resolved once for every candidate
        device, choice = plan_device(cfg, measure=True)
    except KeyError as exc:
        problems.append(Problem(("cluster.gpu",), str(exc.args[0])))
    if problems:
        raise PlanError(problems)
    cfg = with_precision(cfg, choice.precision)
    world = world or cluster_world_size(cfg.cluster)
    batch = global_batch_of(cfg, world)
    flash = uses_flash(cfg, device)
    budget = device.memory_bytes * (1 - cfg.search.headroom)
    engines = engine_presets(cfg, engine_names(cfg))
    calibration, _ = find_calibration(cfg, device)  # one probe serves every candidate
    searched, ranked, excluded = 0, [], []
    for candidate in candidates(cfg, world, batch):
        searched += 1
        result = assess(cfg, candidate, world=world, global_batch=batch, device=device,
                        flash=flash, budget=budget, engines=engines, explain=explain,
                        calibration=calibration)
        if isinstance(result, Scored):
            ranked.append(result)
        elif result is not None:
            excluded.append(result)
    ranked.sort(key=_rank_key)
    measured = calibration is not None and any(s.step.measured for s in ranked)
    source = calibration.measured_label if measured else \
        f"rates of {device.rates}" if device.rates else "catalogue"
    return SearchResult(searched, len(ranked), ranked, batch, tuple(excluded), budget, source)


def _rank_key(s: Scored) -> tuple:
    """Predicted step time (in buckets of 0.05%), then the simpler layout: layouts the model
    cannot tell apart (CP=2 x micro-batch 2 vs CP=1 x 1 ...) list the one with fewer splits."""
    c = s.candidate
    return (round(math.log(s.step.total) * 2000), c.cp, c.pp, c.vpp, c.tp, c.ep,
            int(c.split.uneven), -c.micro_batch, c.zero_stage, c.engine)
