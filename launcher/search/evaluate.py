"""Assess one candidate layout: the plan's checks, its memory against the GPU less the
headroom, and the step-time model (:func:`launcher.plan.plan.estimate_layout`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from launcher.config import EngineName, TrainwrightConfig
from launcher.plan.hardware import Device
from launcher.plan.plan import LayoutEstimate, estimate_layout, estimate_step
from launcher.plan.step_time import StepTime
from launcher.search.space import Candidate


@dataclass(frozen=True)
class Scored:
    """A candidate that passed the plan's checks and fits, with its predictions."""

    candidate: Candidate
    estimate: LayoutEstimate
    step: StepTime
    tokens_per_s: float
    mfu: float


def engine_presets(cfg: TrainwrightConfig, names: list[str]) -> dict:
    """{engine name: EngineConfig} as ``engine=<name>`` on the command line selects it: the
    composed one for the composed engine, the group's preset (conf/engine/<name>.yaml) else."""
    from omegaconf import OmegaConf

    from launcher.compose import CONF_DIR
    from launcher.config import EngineConfig

    out = {}
    for name in names:
        if name == cfg.engine.name.value:
            out[name] = cfg.engine
            continue
        merged = OmegaConf.merge(OmegaConf.structured(EngineConfig),
                                 OmegaConf.load(CONF_DIR / "engine" / f"{name}.yaml"))
        out[name] = OmegaConf.to_object(merged)
    return out


def configure(cfg: TrainwrightConfig, c: Candidate, global_batch: int,
              engines: dict | None = None) -> TrainwrightConfig:
    """``cfg`` with the candidate's settings (the composed config is never modified);
    ``engines``: :func:`engine_presets`."""
    p = dataclasses.replace(
        cfg.parallelism, tensor_parallel_size=c.tp, pipeline_parallel_size=c.pp,
        virtual_pipeline_parallel_size=c.vpp, context_parallel_size=c.cp,
        expert_parallel_size=c.ep, sequence_parallel=c.tp > 1, zero_stage=c.zero_stage,
        layers_in_first_stage=c.split.first, layers_in_last_stage=c.split.last,
        account_for_embedding_in_pipeline_split=c.split.embedding,
        account_for_loss_in_pipeline_split=c.split.loss)
    t = dataclasses.replace(cfg.trainer, micro_batch_size=c.micro_batch,
                            global_batch_size=global_batch, activation_recompute=c.recompute)
    e = (engines or {}).get(c.engine) or dataclasses.replace(cfg.engine,
                                                             name=EngineName(c.engine))
    return dataclasses.replace(cfg, parallelism=p, trainer=t, engine=e)


@dataclass(frozen=True)
class Excluded:
    """A candidate the search drops, and why (for the HTML report's grey points)."""

    candidate: Candidate
    reason: str
    memory_bytes: int = 0
    """Per GPU (all ranks on it), when the plan could estimate it (0: refused earlier)."""
    mfu: float = 0.0
    """Predicted, when the memory was the only reason."""


def assess(cfg: TrainwrightConfig, c: Candidate, *, world: int, global_batch: int,
           device: Device, flash: bool, budget: float, engines: dict | None = None,
           explain: bool = True, calibration=None) -> Scored | Excluded | None:
    """The scored candidate; one the plan refuses or that needs more than ``budget`` bytes per
    GPU (all ranks sharing a GPU together) is Excluded with its reason (``explain``), else
    None. ``calibration``: this machine's measured parts (launcher.plan.calibrated)."""
    run = configure(cfg, c, global_batch, engines)
    est, problems = estimate_layout(run, world, device, flash)
    if est is None:
        return Excluded(c, "; ".join(str(p) for p in problems) or "refused") if explain else None
    memory = est.memory.total * cfg.cluster.ranks_per_gpu
    if budget and memory > budget:
        if not explain:
            return None
        return Excluded(c, f"needs {memory / 2**30:.1f} GiB per GPU, over the "
                        f"{budget / 2**30:.1f} GiB the headroom leaves", memory,
                        _scored(cfg, run, c, est, world, global_batch, device, flash,
                                calibration).mfu)
    return _scored(cfg, run, c, est, world, global_batch, device, flash, calibration)


def _scored(cfg, run, c: Candidate, est: LayoutEstimate, world: int, global_batch: int,
            device: Device, flash: bool, calibration=None) -> Scored:
    step = estimate_step(run, est, device, flash, calibration)
    gpus = world / cfg.cluster.ranks_per_gpu
    peak = (device.peak_tflops_fp32 if cfg.trainer.precision.value == "fp32"
            else device.peak_tflops_bf16) * 1e12
    seconds = step.total
    tokens = global_batch * cfg.model.seq_length
    return Scored(c, est, step, tokens / seconds, est.flops_per_step / (gpus * peak * seconds))
