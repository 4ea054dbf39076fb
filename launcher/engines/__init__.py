"""Engine registry: ``engine.name`` -> the engine package's ``SPEC`` (:class:`base.EngineSpec`).

Every engine package's ``__init__`` is torch-free, so the plan asks an engine what it runs and
how much memory it holds without importing torch; ``SPEC.build`` imports the engine's runtime
(torch, Megatron-Core, DeepSpeed). A third engine (e.g. torch FSDP2) is one package under
``launcher/engines/``, one ``EngineName`` in the config schema and one line here.
"""

from __future__ import annotations

from launcher.config import DataFormat, EngineName, TrainwrightConfig
from launcher.engines import deepspeed, megatron
from launcher.engines.base import EngineSpec

REGISTRY: dict[str, EngineSpec] = {spec.name: spec for spec in (deepspeed.SPEC, megatron.SPEC)}
"""Engine name -> its spec."""


def spec(name: EngineName | str) -> EngineSpec:
    """The spec of engine ``name``."""
    if name not in REGISTRY:
        raise KeyError(f"engine={name} is not registered; use one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def engine_inputs(cfg: TrainwrightConfig) -> dict:
    """The narrow sub-configs an engine is built from (keyword arguments of ``build`` and
    ``run_files`` besides the batch and the model)."""
    return dict(parallelism=cfg.parallelism, optimizer=cfg.optimizer,
                trainer=with_per_token_loss(cfg.trainer, cfg.data.format), engine=cfg.engine)


def with_per_token_loss(trainer, data_format: DataFormat):
    """``trainer`` with ``per_token_loss`` resolved (null: on for data.format=chat)."""
    import dataclasses

    if trainer.per_token_loss is not None:
        return trainer
    return dataclasses.replace(trainer, per_token_loss=data_format == DataFormat.chat)
