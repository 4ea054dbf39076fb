"""Engine registry: ``engine.name`` -> the engine package's ``SPEC`` (:class:`base.EngineSpec`).

Looking a spec up imports only its package's torch-free ``__init__``, so the plan can ask an
engine what it runs and how much memory it holds without torch; ``SPEC.build`` imports the
runtime. A third engine (e.g. torch FSDP2) is one package under ``launcher/engines/`` and one
line here.
"""

from __future__ import annotations

import importlib

from launcher.engines.base import EngineSpec

REGISTRY = {
    "deepspeed": "launcher.engines.deepspeed",
    "megatron": "launcher.engines.megatron",
}
"""Engine name -> package defining ``SPEC``."""


def spec(name) -> EngineSpec:
    """The spec of engine ``name`` (an EngineName or its string)."""
    key = getattr(name, "value", name)
    if key not in REGISTRY:
        raise KeyError(f"engine={key!r} is not registered; use one of {', '.join(REGISTRY)}")
    return importlib.import_module(REGISTRY[key]).SPEC


def build_engine(plan, *, model, parallelism, optimizer, trainer, engine):
    """The runtime engine of ``engine.name`` on an initialised parallel state (collective)."""
    return spec(engine.name).build(plan, model=model, parallelism=parallelism,
                                   optimizer=optimizer, trainer=trainer, engine=engine)
