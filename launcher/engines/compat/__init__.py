"""Every patch of a library internal, one module per library it patches, each patch beside the
probe that says the unpatched library still needs it; :func:`install` applies the process-wide
ones once per process.

:data:`SHIMS` lists them all: what each patches, the library version it was written for, when it
applies (no CUDA, or no Transformer Engine, on a CPU or a GPU machine alike) and its probe.
``tests/test_compat.py`` fails when an installed library is not the version a shim was written
for, or when a probe finds the library fixed, so a library upgrade is a deliberate step.

- :mod:`.megatron_on_cpu`: Megatron-Core on a machine without CUDA (applied by :func:`install`);
- :mod:`.megatron_core`: Megatron-Core without Transformer Engine (applied by :func:`install`),
  and around its distributed-optimizer loads and asynchronous saves (applied by their callers);
- :mod:`.torch_loads`: checkpoint reads that run no code (torch, whoever calls it);
- :mod:`.torch_elastic`: torch's elastic agent, and its JIT extensions' build locks;
- :mod:`.deepspeed_runtime`: DeepSpeed's start-up;
- :mod:`.lm_eval_templates`: lm-evaluation-harness's task templates;
- :mod:`.transformer_engine`: Transformer Engine hidden on request.

Call :func:`install` at the start of every training process (``launcher.train``'s worker, the
test workers), never from model or engine builders. Every patch names the library site that
needs it.
"""

from __future__ import annotations

import os

from launcher.engines.compat import (deepspeed_runtime, lm_eval_templates, megatron_core,
                                     megatron_on_cpu, torch_elastic, torch_loads)
from launcher.engines.compat.deepspeed_runtime import prepare_deepspeed, skip_cpu_shm_build
from launcher.engines.compat.lm_eval_templates import compiled_templates_kept
from launcher.engines.compat.megatron_core import (keep_adam_step, unshare_adam_steps,
                                                   start_save_results_queue)
from launcher.engines.compat.megatron_on_cpu import cpu_mode_active
from launcher.engines.compat.shim import Shim
from launcher.engines.compat.torch_elastic import monitored_elastic_agent, store_loss_tolerant
from launcher.engines.compat.torch_loads import checkpoint_loads_without_code
from launcher.engines.compat.transformer_engine import (DISABLE_TE_ENV, hide_transformer_engine,
                                                        transformer_engine_available)

__all__ = ["SHIMS", "Shim", "install", "shape_imports", "cpu_mode_active",
           "checkpoint_loads_without_code", "keep_adam_step", "unshare_adam_steps",
           "start_save_results_queue", "monitored_elastic_agent", "store_loss_tolerant",
           "prepare_deepspeed", "skip_cpu_shm_build", "compiled_templates_kept",
           "transformer_engine_available", "DISABLE_TE_ENV"]

SHIMS: tuple[Shim, ...] = (*megatron_on_cpu.SHIMS, *megatron_core.SHIMS, *torch_loads.SHIMS,
                           *torch_elastic.SHIMS, *deepspeed_runtime.SHIMS,
                           *lm_eval_templates.SHIMS)
"""Every patch of a library internal, in the order :func:`install` applies them."""

_APPLIED: list = []
"""Names of the shims :func:`install` applied in this process."""


def install() -> list:
    """Apply every shim whose condition holds in this process, once; the names applied now or
    before. Call at the start of each training process (before Megatron-Core builds anything)."""
    if os.environ.get(DISABLE_TE_ENV) == "1":
        hide_transformer_engine()
    for shim in SHIMS:
        if shim.apply is not None and shim.name not in _APPLIED and shim.when():
            shim.apply()
            _APPLIED.append(shim.name)
    return list(_APPLIED)


def shape_imports() -> None:
    """What :func:`install` does on a machine without CUDA before Megatron-Core is imported
    (Transformer Engine hidden under TRAINWRIGHT_DISABLE_TE=1, Megatron-Core imported with its
    fused kernels eager), for a process that imports a CPU rank's libraries before it is one
    (:mod:`launcher.launch.rank_preload`)."""
    if os.environ.get(DISABLE_TE_ENV) == "1":
        hide_transformer_engine()
    megatron_on_cpu.eager_fusers()
