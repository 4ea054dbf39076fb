"""DeepSpeed 0.19.8's start-up costs on a CPU machine and in bf16 (an op built, Dynamo imported,
forced garbage collections), each beside the probe that says the library still has it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from launcher.engines.compat.shim import Shim, applied_by_caller, compile_as_identity


def prepare_deepspeed() -> None:
    """The DeepSpeed engine's start-up shims (:data:`SHIMS`), before ``deepspeed.init_distributed``:
    no shm op build and an eager Muon import on CPU, no forced memory reports anywhere."""
    skip_cpu_shm_build()
    eager_muon_on_cpu()
    quiet_bf16_optimizer()


def skip_cpu_shm_build() -> None:
    """DeepSpeed's ``TorchBackend`` JIT-builds (and every rank loads) its shared-memory comm op
    on a CPU accelerator (``deepspeed.comm.torch.build_shm_op``, DeepSpeed 0.19.8); it serves
    ``inference_all_reduce`` only, which training never calls. Building it cost seconds of
    every CPU start-up and, when a build was killed, left the lock that hung every later run.
    Called by the DeepSpeed engine before ``deepspeed.init_distributed`` on CPU-only
    processes."""
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch is torch
    if torch.cuda.is_available() or getattr(ds_torch.build_shm_op, "_trainwright", False):
        return

    def no_shm_op():
        return None

    no_shm_op._trainwright = True
    ds_torch.build_shm_op = no_shm_op


def _probe_shm_build() -> bool:
    import importlib
    import inspect

    ds_torch = importlib.import_module("deepspeed.comm.torch")

    return ("builder.load()" in inspect.getsource(ds_torch.build_shm_op)
            and "build_shm_op()" in inspect.getsource(ds_torch.TorchBackend.__init__))


def eager_muon_on_cpu() -> None:
    """``deepspeed.initialize`` checks the client optimizer against the ZeRO-supported ones and
    imports DeepSpeed's Muon to do so (``zero/utils.py is_zero_supported_optimizer``, DeepSpeed
    0.19.8), whose Newton-Schulz step is decorated with ``torch.compile``: Dynamo and Inductor
    imported, 3 s of every CPU start-up, for an optimizer trainwright never uses. On CPU the
    module is imported with ``torch.compile`` as the identity."""
    if torch.cuda.is_available() or "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules:
        return
    with compile_as_identity():
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401


def _probe_muon_compile() -> bool:
    import inspect

    from deepspeed.runtime.zero import utils

    source = Path(utils.__file__).parent / "muon" / "original_muon.py"
    return ("muon_optimizer import" in inspect.getsource(utils.is_zero_supported_optimizer)
            and "@compiler.compile()" in source.read_text())


def quiet_bf16_optimizer() -> None:
    """DeepSpeed 0.19.8's ``BF16_Optimizer.__init__`` calls ``see_memory_usage(..., force=True)``
    four times plus twice per parameter group, and each call runs ``gc.collect()`` (0.45 s with
    torch and Megatron-Core loaded) to print memory banners into the rank log: 2.7 s of every
    bf16 DeepSpeed start-up. Its module's reference is replaced by a no-op."""
    from deepspeed.runtime import bf16_optimizer

    bf16_optimizer.see_memory_usage = lambda message, force=False: None


def _probe_bf16_memory_reports() -> bool:
    import inspect

    from deepspeed.runtime import bf16_optimizer, utils

    return ("force=True" in inspect.getsource(bf16_optimizer.BF16_Optimizer.__init__)
            and "gc.collect()" in inspect.getsource(utils.see_memory_usage))


SHIMS = (
    Shim("no shared-memory comm op on CPU", "deepspeed", "0.19.8", applied_by_caller, None,
         _probe_shm_build, "skip_cpu_shm_build, before deepspeed.init_distributed: TorchBackend "
         "JIT-builds deepspeed_shm_comm (inference all-reduce only) in every CPU rank"),
    Shim("eager Muon import on CPU", "deepspeed", "0.19.8", applied_by_caller, None,
         _probe_muon_compile, "eager_muon_on_cpu: deepspeed.initialize imports Muon, whose "
         "torch.compile decorator imports Dynamo and Inductor (3 s per CPU rank)"),
    Shim("no forced memory reports", "deepspeed", "0.19.8", applied_by_caller, None,
         _probe_bf16_memory_reports, "quiet_bf16_optimizer: BF16_Optimizer forces "
         "see_memory_usage, each a gc.collect() (2.7 s of every bf16 start-up)"),
)
