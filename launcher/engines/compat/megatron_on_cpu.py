"""Megatron-Core 0.16.1 on a machine without CUDA: it assumes a GPU in a handful of places (buffers
created on ``torch.cuda.current_device()``, CUDA RNG states, ``device="cuda"`` tensors, CUDA type
strings), and each is redirected to the host here, beside the probe that says the library still
does it. The torch function mode is thread-local: it covers the thread that called
:func:`launcher.engines.compat.install` (the training loop; CPU autograd runs its backward in that
same thread). Its fused kernels are imported eager (:func:`eager_fusers`)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from launcher.engines.compat.shim import Shim, compile_as_identity, cpu_only

_STATE = {"mode": None}
"""The CPU mode entered in this process (None: not entered)."""

# Tensor.type() names a CPU tensor reports while the mode is active (cuda type-string checks).
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device) -> bool:
    """True for "cuda", "cuda:N", torch.device("cuda") and ints (CUDA indices on CPU builds)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Maps ``device="cuda"`` to the CPU, ``Tensor.cuda()`` to identity, and makes ``Tensor.type()``
    report CUDA type names for CPU float tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            # pipeline_parallel/p2p_communication.py, optimizer/grad_scaler.py load_state_dict.
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            # optimizer/clip_grads.py asserts grad.type() == 'torch.cuda.FloatTensor';
            # optimizer/optimizer.py and distrib_optimizer.py branch on torch.cuda.*Tensor names.
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            # pipeline_parallel/schedules.py torch.zeros([], device="cuda"), optimizer/clip_grads.py
            # and optimizer/optimizer.py torch.tensor(..., device='cuda'), transformer/utils.py
            # causal masks.
            kwargs = {**kwargs, "device": "cpu"}
        elif func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            # tensor.to("cuda") / tensor.to(torch.cuda.current_device()) style moves.
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _under_mode(fn):
    """Wrap ``fn`` so it runs under :class:`CudaToCpuMode`: the autograd engine clears the torch
    function mode stack while it runs backward functions and hooks."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack()):
            return fn(*args, **kwargs)
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    wrapper._trainwright_cpu = True
    return wrapper


def _patch_recompute() -> None:
    """Activation recompute runs the layer forward inside backward, where the mode is not active."""
    from megatron.core.tensor_parallel import random as mrandom

    fn_cls, hook_cls = mrandom.CheckpointFunction, mrandom.CheckpointWithoutOutput
    if not getattr(fn_cls.backward, "_trainwright_cpu", False):
        # random.py CheckpointFunction.backward (full/selective recompute) re-runs the forward,
        # e.g. transformer/utils.py get_default_causal_mask torch.ones(..., device="cuda").
        fn_cls.backward = staticmethod(_under_mode(fn_cls.backward))
    if not getattr(hook_cls._recompute, "_trainwright_cpu", False):
        # random.py CheckpointWithoutOutput._recompute: backward hook (output-discarding recompute).
        hook_cls._recompute = _under_mode(hook_cls._recompute)


def _probe_recompute() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return hasattr(mrandom.CheckpointFunction, "backward") and \
        hasattr(mrandom.CheckpointWithoutOutput, "_recompute")


def _cpu_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    """CPU stand-in for random._get_cuda_rng_state: the default CPU generator's state."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False) -> None:
    """CPU stand-in for random._set_cuda_rng_state."""
    torch.set_rng_state(new_state)


def _cpu_tracker_class():
    """A CudaRNGStatesTracker whose named states are CPU generator states."""
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """CPU dropout draws from the default CPU generator; the tracked streams live there."""

        def add(self, name, seed):
            """Same contract as the CUDA tracker: a new named stream seeded with ``seed``."""
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            """Like the CUDA fork, minus its "CPU RNG state changed" warning, which on CPU would
            fire on every dropout."""
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state, orig_name = torch.get_rng_state(), self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _patch_rng() -> None:
    """Route Megatron's model-parallel RNG machinery to the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    # random.py CheckpointFunction / _get_all_rng_states call these module functions directly.
    mrandom._get_cuda_rng_state = _cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    # random.py initialize_rng_tracker instantiates the module-level CudaRNGStatesTracker name.
    if not getattr(mrandom.CudaRNGStatesTracker, "_trainwright_cpu", False):
        cls = _cpu_tracker_class()
        cls._trainwright_cpu = True
        mrandom.CudaRNGStatesTracker = cls
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, mrandom.CudaRNGStatesTracker):
        # A CUDA tracker created before enable(): drop it so the next seed call builds a CPU one.
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _probe_rng() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return hasattr(mrandom, "_get_cuda_rng_state") and hasattr(mrandom, "CudaRNGStatesTracker")


def _patch_torch_cuda() -> None:
    """Replace the torch.cuda entry points Megatron calls unconditionally."""
    # core/utils.py GlobalMemoryBuffer, RoPE inv_freq, layers.py buffers: device=current_device().
    torch.cuda.current_device = lambda: torch.device("cpu")
    # pipeline_parallel/p2p_communication.py and dist_checkpointing writers call synchronize().
    torch.cuda.synchronize = lambda device=None: None
    # optimizer/optimizer.py offload paths and pipeline_parallel activation offload.
    torch.cuda.empty_cache = lambda: None


def _probe_cuda_calls() -> bool:
    """Megatron-Core's schedules still create ``device="cuda"`` tensors."""
    import inspect

    from megatron.core.pipeline_parallel import schedules

    return 'device="cuda"' in inspect.getsource(schedules)


def eager_fusers() -> None:
    """Megatron-Core 0.16.1 decorates its fused kernels (``megatron/core/fusions``: bias-GeLU,
    GeGLU, SwiGLU, bias-dropout-add, ...) with ``jit_fuser = torch.compile`` as they are
    imported, and ``torch.compile`` imports TorchDynamo and Inductor to look up its default
    backend: about 2.5 s of every CPU rank's start-up (measured: ``import
    megatron.core.models.gpt`` 2.7 s -> 0.6 s after torch), for kernels a CPU run never calls
    (the engines turn bias-activation fusion off without CUDA). On CPU, Megatron-Core is
    imported with ``torch.compile`` as the identity and its ``jit_fuser`` left disabled, so any
    fused function that does run is its plain eager self (same numbers)."""
    if "megatron.core" in sys.modules:
        return  # too late to change how its kernels were decorated
    with compile_as_identity():
        import megatron.core.jit as jit

        jit.disable_jit_fuser()


def _probe_eager_fusers() -> bool:
    import inspect

    source = Path(inspect.getfile(torch)).parent.parent / "megatron" / "core" / "jit.py"
    text = source.read_text() if source.exists() else ""
    return "jit_fuser = torch.compile" in text and "enable_jit_fuser()" in text


def _enter_cpu_mode() -> None:
    """DeepSpeed's accelerator auto-detection looks for CUDA; the mode maps CUDA calls to CPU."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _STATE["mode"] = CudaToCpuMode()
    _STATE["mode"].__enter__()


def cpu_mode_active() -> bool:
    """Whether the CPU redirects are applied in this process."""
    return _STATE["mode"] is not None


SHIMS = (
    Shim("eager fusers on CPU", "megatron-core", "0.16.1", cpu_only, eager_fusers,
         _probe_eager_fusers, "megatron/core/jit.py: jit_fuser = torch.compile decorates the "
         "fused kernels at import, importing Dynamo and Inductor (2.5 s per CPU rank)"),
    Shim("torch.cuda entry points", "megatron-core", "0.16.1", cpu_only, _patch_torch_cuda,
         _probe_cuda_calls, "buffers on torch.cuda.current_device(), synchronize(), "
         "empty_cache() in core/utils.py, p2p_communication.py, dist-checkpointing writers"),
    Shim("CPU RNG tracker", "megatron-core", "0.16.1", cpu_only, _patch_rng, _probe_rng,
         "tensor_parallel/random.py keeps CUDA generator states"),
    Shim("recompute under the CPU mode", "megatron-core", "0.16.1", cpu_only,
         _patch_recompute, _probe_recompute,
         "activation recompute re-runs forward inside backward, outside the torch function mode"),
    Shim("device='cuda' to CPU mode", "megatron-core", "0.16.1", cpu_only, _enter_cpu_mode,
         _probe_cuda_calls, "schedules.py, clip_grads.py, optimizer.py create CUDA tensors and "
         "check CUDA type strings"),
)
