"""Every patch of a library internal, in one place, applied once per process by :func:`install`.

:data:`SHIMS` lists them: what each patches, the library version it was written for, when it
applies (no CUDA, or no Transformer Engine, on a CPU or a GPU machine alike) and a probe that
says whether the unpatched library still needs it. ``tests/test_compat.py`` fails when an
installed library is not the version a shim was written for, or when a probe finds the library
fixed, so a library upgrade is a deliberate step. (The Megatron-Core distributed-optimizer
checkpoint workarounds, which wrap single optimizer instances for the duration of a load, are
:func:`keep_adam_step` and :func:`unshare_adam_steps`, and the loads of checkpoint files that
run no code are :func:`checkpoint_loads_without_code`'s, all listed there too.)

On a machine without CUDA, Megatron-Core 0.16.1 assumes a GPU in a handful of places (buffers
created on ``torch.cuda.current_device()``, CUDA RNG states, ``device="cuda"`` tensors, CUDA type
strings); the CPU shims redirect each to the host. The torch function mode they install is
thread-local: it covers the thread that called :func:`install` (the training loop; CPU autograd
runs its backward in that same thread). Call :func:`install` at the start of every training
process (``launcher.train``'s worker, the test workers), never from model or engine builders.

Every patch names the Megatron-Core / DeepSpeed site that needs it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import sys
import threading
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from launcher.core.stop import ignore_stop_signals
from launcher.engines import unpickle

_STATE = {"mode": None, "applied": []}

DISABLE_TE_ENV = "TRAINWRIGHT_DISABLE_TE"
"""Set to 1 to make this process behave as if Transformer Engine were not installed."""

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


def _patch_torch_cuda() -> None:
    """Replace the torch.cuda entry points Megatron calls unconditionally."""
    # core/utils.py GlobalMemoryBuffer, RoPE inv_freq, layers.py buffers: device=current_device().
    torch.cuda.current_device = lambda: torch.device("cpu")
    # pipeline_parallel/p2p_communication.py and dist_checkpointing writers call synchronize().
    torch.cuda.synchronize = lambda device=None: None
    # optimizer/optimizer.py offload paths and pipeline_parallel activation offload.
    torch.cuda.empty_cache = lambda: None


def _patch_moe_router() -> None:
    """transformer/moe/moe_utils.py RouterGatingLinearFunction reads te_general_gemm, which is only
    defined when Transformer Engine imports (NameError in every MoE forward without TE)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_mla_te_flag() -> None:
    """transformer/multi_latent_attention.py sets HAVE_TE when its import of
    megatron.core.extensions.transformer_engine succeeds, which it does without Transformer
    Engine (stand-in classes), then calls isinstance(x, TELinear) on a stand-in: TypeError
    building any multi-latent-attention layer."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


@contextlib.contextmanager
def keep_adam_step(subs: list):
    """While loading distributed-optimizer state into the torch Adam of ``subs`` (no Transformer
    Engine or Apex FusedAdam), keep the per-parameter ``step`` that ``load_state_dict`` has just
    set from the checkpoint's param groups, whatever the per-parameter tensors bring.

    Megatron-Core 0.16.1 (torch Adam):

    * ``load_parameter_state_from_fully_reshardable`` leaves ``step`` out of the tensors it hands
      to ``_set_main_param_and_optimizer_states``, which then copies every key of the torch
      state, ``step`` included: KeyError 'step';
    * ``load_parameter_state_from_dp_reshardable`` hands over the ``step`` of the state the load
      was prepared with (the primed zeros), not the saved one: the resumed run restarts Adam's
      bias correction at step 1 (its second step differs from the straight run's).

    (FusedAdam keeps the step in the param group, so on those installs there is nothing to do.)"""
    patched = list(subs)
    for sub in patched:
        original = sub._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _sub=sub, _original=original):
            group_index, group_order = _sub.model_param_group_index_map[model_param]
            main_param = _sub.optimizer.param_groups[group_index]["params"][group_order]
            current = _sub.optimizer.state.get(main_param, {})
            if "step" in current:
                tensors = {**tensors, "step": current["step"]}
            _original(model_param, tensors)

        sub._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states


def unshare_adam_steps(subs: list) -> None:
    """Give every parameter its own Adam ``step`` tensor after a distributed-optimizer load.

    Megatron-Core 0.16.1 ``DistributedOptimizer.load_state_dict`` (torch Adam path) assigns one
    ``step`` tensor to every parameter's state, and torch keeps it as is; torch Adam then adds 1
    to that shared tensor once per parameter, so after one step the count is off by the number of
    parameters and every later bias correction is wrong (the first step after a resume still
    matches, the second does not)."""
    for sub in subs:
        for state in sub.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _start_results_queue():
    """Megatron-Core's save-results queue, created here with a server that survives stop
    signals (its own ``_get_write_results_queue`` spawns one that SIGTERM or SIGUSR1 to the
    process group kills, after which the save that the signal asked for fails with
    ConnectionRefusedError)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=ignore_stop_signals)  # a stop is for the ranks
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
    return filesystem_async._results_queue


def warm_save_results_queue() -> threading.Thread:
    """Start Megatron-Core's save-results queue in a thread; join it before the first save.

    Megatron-Core 0.16.1 (``strategies/filesystem_async._get_write_results_queue``) hands every
    save's write results back through a ``Manager().Queue()`` whose server it spawns at the first
    save. Two problems, both fixed by creating that queue here (:func:`_start_results_queue`):
    the server imports torch when it unpickles the first results (2.0 s measured on the 2-core
    machine, inside every run's first, often only, save), and a stop signal sent to the process
    group kills it, so the save on a stop request failed once any save had started the server.
    The thread starts the server and sends one torch object through it, so the import happens
    while training goes on. A failure here is left for the save itself to meet and report."""

    def warm() -> None:
        with contextlib.suppress(Exception):
            from torch.distributed.checkpoint.metadata import MetadataIndex
            from torch.distributed.checkpoint.storage import WriteResult

            queue = _start_results_queue()
            queue.put({-1: [WriteResult(index=MetadataIndex("warm-up"), size_in_bytes=0,
                                        storage_data=None)]})
            queue.get()

    thread = threading.Thread(target=warm, name="save-results-queue-warm-up", daemon=True)
    thread.start()
    return thread


def _hide_transformer_engine() -> None:
    """With TRAINWRIGHT_DISABLE_TE=1, make ``import transformer_engine`` fail in this process, so
    a GPU machine that has TE can run (and test) the paths taken where TE is not installed."""
    import importlib.abc

    class _NoTransformerEngine(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "transformer_engine" or name.startswith("transformer_engine."):
                raise ModuleNotFoundError(f"{name} hidden by TRAINWRIGHT_DISABLE_TE=1")
            return None

    if not any(type(f).__name__ == "_NoTransformerEngine" for f in sys.meta_path):
        sys.meta_path.insert(0, _NoTransformerEngine())


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine`` imports here (and is not hidden by TRAINWRIGHT_DISABLE_TE)."""
    if os.environ.get(DISABLE_TE_ENV) == "1":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _cpu_only() -> bool:
    return not torch.cuda.is_available()


def _eager_fusers() -> None:
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
    with _compile_as_identity():
        import megatron.core.jit as jit

        jit.disable_jit_fuser()


@contextlib.contextmanager
def _compile_as_identity() -> Iterator[None]:
    """While inside, ``torch.compile`` (as a decorator or a call) returns what it is given."""
    compile_ = torch.compile

    def identity(model=None, **_):
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        yield
    finally:
        torch.compile = compile_


def _probe_eager_fusers() -> bool:
    import inspect

    source = Path(inspect.getfile(torch)).parent.parent / "megatron" / "core" / "jit.py"
    text = source.read_text() if source.exists() else ""
    return "jit_fuser = torch.compile" in text and "enable_jit_fuser()" in text


def _without_te() -> bool:
    return not transformer_engine_available()


def _enter_cpu_mode() -> None:
    """DeepSpeed's accelerator auto-detection looks for CUDA; the mode maps CUDA calls to CPU."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _STATE["mode"] = CudaToCpuMode()
    _STATE["mode"].__enter__()


def _applied_by_caller() -> bool:
    """Not installed process-wide: the checkpoint IO applies it (keep_adam_step around each load,
    warm_save_results_queue before the first save)."""
    return False


def _probe_moe_router() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm")


def _probe_mla_te_flag() -> bool:
    from megatron.core.transformer import multi_latent_attention as mla

    return mla.HAVE_TE and not isinstance(mla.TELinear, type)


def _probe_rng() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return hasattr(mrandom, "_get_cuda_rng_state") and hasattr(mrandom, "CudaRNGStatesTracker")


def _probe_recompute() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return hasattr(mrandom.CheckpointFunction, "backward") and \
        hasattr(mrandom.CheckpointWithoutOutput, "_recompute")


def _probe_cuda_calls() -> bool:
    """Megatron-Core's schedules still create ``device="cuda"`` tensors."""
    import inspect

    from megatron.core.pipeline_parallel import schedules

    return 'device="cuda"' in inspect.getsource(schedules)


def _probe_results_queue() -> bool:
    """Save results still come back through a queue of a spawned Manager, created lazily,
    whose server keeps the default signal handlers."""
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    source = inspect.getsource(filesystem_async._get_write_results_queue)
    return filesystem_async._results_queue is None and "Manager()" in source \
        and "initializer" not in source


def _probe_adam_step() -> bool:
    """The fully-reshardable load still leaves ``step`` out (see :func:`keep_adam_step`)."""
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return hasattr(DistributedOptimizer, "_set_main_param_and_optimizer_states") and \
        "load_parameter_state_from_fully_reshardable" in inspect.getsource(DistributedOptimizer)


class _MetadataPickle:
    """torch DCP's ``pickle`` module as :func:`checkpoint_loads_without_code` hands it: ``load``
    is :func:`unpickle.load_metadata`, everything else is pickle's."""

    load = staticmethod(unpickle.load_metadata)

    def __getattr__(self, name: str):
        return getattr(pickle, name)


@contextlib.contextmanager
def checkpoint_loads_without_code() -> Iterator[None]:
    """While inside, every ``torch.load`` of this process loads weights only plus what
    :mod:`launcher.engines.unpickle` allows, whatever its caller asks (DeepSpeed 0.19.8's
    ``TorchCheckpointEngine.load`` and torch 2.13's DCP ``DefaultLoadPlanner.load_bytes`` pass
    ``weights_only=False``), and torch DCP's ``.metadata`` is unpickled by
    :class:`unpickle.MetadataUnpickler` (``FileSystemReader.read_metadata`` calls
    ``pickle.load``). Wrap every read of a checkpoint in it; re-entrant. A refusal that the
    library wrapped into an error of its own (DCP collects every rank's exceptions into a
    ``CheckpointException``) leaves as the refusal itself, so the command exits 2 naming it."""
    from torch.distributed.checkpoint import filesystem

    if _STATE.get("safe_loads"):
        yield
        return
    saved, refused = (torch.load, filesystem.pickle), len(unpickle.REFUSED)
    torch.load, filesystem.pickle = unpickle.load, _MetadataPickle()
    _STATE["safe_loads"] = True
    try:
        yield
    except unpickle.UnsafeCheckpointFile:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if len(unpickle.REFUSED) > refused and not isinstance(exc, (KeyboardInterrupt,
                                                                    SystemExit)):
            raise unpickle.REFUSED[-1] from exc
        raise
    finally:
        torch.load, filesystem.pickle = saved
        _STATE["safe_loads"] = False


def _probe_deepspeed_unsafe_load() -> bool:
    """DeepSpeed still loads its checkpoint files with ``weights_only=False``."""
    import inspect

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return "weights_only=False" in inspect.getsource(TorchCheckpointEngine.load)


def _probe_dcp_unsafe_load() -> bool:
    """torch DCP still unpickles ``.metadata`` with ``pickle.load`` and byte items with
    ``weights_only=False``."""
    import inspect

    from torch.distributed.checkpoint import default_planner, filesystem

    return "pickle.load(" in inspect.getsource(filesystem.FileSystemReader.read_metadata) and \
        "weights_only=False" in inspect.getsource(default_planner.DefaultLoadPlanner.load_bytes)


@contextlib.contextmanager
def monitored_elastic_agent(monitor: Optional[Callable] = None) -> Iterator[None]:
    """Within the block, the agents torch elastic's launcher builds (1) call
    ``monitor(agent, worker_group, result)`` after each of their own health checks and use
    its answer (the hang watchdog and restart policy of :mod:`launcher.launch.watchdog`), when
    ``monitor`` is given, and (2) outlive the rendezvous store while their workers run
    (:func:`store_loss_tolerant`).

    torch 2.13's ``launch_agent`` builds ``LocalElasticAgent`` by its module-level name and the
    agent's loop (``SimpleElasticAgent._invoke_run``) restarts the worker group while
    ``_remaining_restarts`` > 0 after ``_monitor_workers`` reports FAILED; the monitor may set
    ``agent._remaining_restarts = 0`` to make a failure final. While the workers are healthy
    the same loop asks ``spec.rdzv_handler.num_nodes_waiting()``, which reads the c10d store
    that the first node's agent hosts."""
    import torch.distributed.launcher.api as api

    base = api.LocalElasticAgent

    class MonitoredAgent(base):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            return monitor(self, worker_group, result) if monitor is not None else result

        def _invoke_run(self, role):
            store_loss_tolerant(self._worker_group.spec.rdzv_handler)
            return super()._invoke_run(role)

    api.LocalElasticAgent = MonitoredAgent
    try:
        yield
    finally:
        api.LocalElasticAgent = base


def store_loss_tolerant(handler) -> None:
    """Make ``handler.num_nodes_waiting()`` answer 0 ("no new node") when the rendezvous store
    cannot be reached, instead of raising.

    The store lives in the first node's agent. When every rank stops for requeue, that node's
    ranks may exit first and its agent with them; another node's agent, whose rank is still
    finishing the same exit 75, then failed its next poll with RendezvousConnectionError, shut
    its rank down and exited 1, so a clean stop (requeue, pod restarted uncounted) read as a
    crash. Its workers' own exit codes decide now; a store lost for another reason still
    fails the workers' collectives, and the agent sees that."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    if getattr(handler.num_nodes_waiting, "store_loss_tolerant", False):
        return
    asking = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        try:
            return asking()
        except RendezvousConnectionError:
            return 0

    num_nodes_waiting.store_loss_tolerant = True
    handler.num_nodes_waiting = num_nodes_waiting


def prepare_deepspeed() -> None:
    """The DeepSpeed engine's start-up shims (:data:`SHIMS`), before ``deepspeed.init_distributed``:
    no shm op build and an eager Muon import on CPU, no forced memory reports anywhere."""
    skip_cpu_shm_build()
    eager_muon_on_cpu()
    quiet_bf16_optimizer()


def eager_muon_on_cpu() -> None:
    """``deepspeed.initialize`` checks the client optimizer against the ZeRO-supported ones and
    imports DeepSpeed's Muon to do so (``zero/utils.py is_zero_supported_optimizer``, DeepSpeed
    0.19.8), whose Newton-Schulz step is decorated with ``torch.compile``: Dynamo and Inductor
    imported, 3 s of every CPU start-up, for an optimizer trainwright never uses. On CPU the
    module is imported with ``torch.compile`` as the identity."""
    if torch.cuda.is_available() or "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules:
        return
    with _compile_as_identity():
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401


def quiet_bf16_optimizer() -> None:
    """DeepSpeed 0.19.8's ``BF16_Optimizer.__init__`` calls ``see_memory_usage(..., force=True)``
    four times plus twice per parameter group, and each call runs ``gc.collect()`` (0.45 s with
    torch and Megatron-Core loaded) to print memory banners into the rank log: 2.7 s of every
    bf16 DeepSpeed start-up. Its module's reference is replaced by a no-op."""
    from deepspeed.runtime import bf16_optimizer

    bf16_optimizer.see_memory_usage = lambda message, force=False: None


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


def compiled_templates_kept() -> None:
    """lm-evaluation-harness compiles a task's Jinja template again for every document it
    renders (``utils.apply_template``: ``env.from_string`` at each call, 0.6 ms here): 0.6 s of
    every rank's 2.6 s for 240 four-choice questions, and minutes for a task of tens of
    thousands of documents. Each template text is compiled once (the same ``env``, so the same
    filters and undefined rule); what renders is unchanged. Applied by the harness before a run
    of tasks."""
    from lm_eval import utils

    if getattr(utils.apply_template, "_trainwright_cached", False):
        return

    @functools.lru_cache(maxsize=4096)
    def compiled(template: str):
        return utils.env.from_string(template)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    apply_template._trainwright_cached = True
    utils.apply_template = apply_template


def _probe_template_compiles() -> bool:
    import inspect

    from lm_eval import utils

    source = Path(inspect.getfile(utils)).read_text()
    return ("def apply_template(template: str, doc: dict) -> str:\n"
            "    rtemplate = env.from_string(template)" in source)


def _probe_jit_baton() -> bool:
    import inspect

    from torch.utils import cpp_extension

    return "baton.wait()" in inspect.getsource(cpp_extension._jit_compile)


def _probe_shm_build() -> bool:
    import importlib
    import inspect

    ds_torch = importlib.import_module("deepspeed.comm.torch")

    return ("builder.load()" in inspect.getsource(ds_torch.build_shm_op)
            and "build_shm_op()" in inspect.getsource(ds_torch.TorchBackend.__init__))


def _probe_muon_compile() -> bool:
    import inspect

    from deepspeed.runtime.zero import utils

    source = Path(utils.__file__).parent / "muon" / "original_muon.py"
    return ("muon_optimizer import" in inspect.getsource(utils.is_zero_supported_optimizer)
            and "@compiler.compile()" in source.read_text())


def _probe_bf16_memory_reports() -> bool:
    import inspect

    from deepspeed.runtime import bf16_optimizer, utils

    return ("force=True" in inspect.getsource(bf16_optimizer.BF16_Optimizer.__init__)
            and "gc.collect()" in inspect.getsource(utils.see_memory_usage))


def _probe_elastic_monitor() -> bool:
    import inspect

    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    loop = inspect.getsource(SimpleElasticAgent._invoke_run)
    return ("LocalElasticAgent(" in inspect.getsource(api.launch_agent)
            and "self._monitor_workers(" in loop and "self._remaining_restarts > 0" in loop
            and "rdzv_handler.num_nodes_waiting()" in loop)


@dataclass(frozen=True)
class Shim:
    """One patch of a library internal."""

    name: str
    library: str
    version: str  # the version it was written for (tests compare it with the installed one)
    when: Callable[[], bool]  # applies in this process (e.g. no CUDA); None = applied by caller
    apply: Optional[Callable[[], None]]
    needed: Callable[[], bool]  # the unpatched library still has what the shim works around
    why: str


SHIMS = (
    Shim("eager fusers on CPU", "megatron-core", "0.16.1", _cpu_only, _eager_fusers,
         _probe_eager_fusers, "megatron/core/jit.py: jit_fuser = torch.compile decorates the "
         "fused kernels at import, importing Dynamo and Inductor (2.5 s per CPU rank)"),
    Shim("torch.cuda entry points", "megatron-core", "0.16.1", _cpu_only, _patch_torch_cuda,
         _probe_cuda_calls, "buffers on torch.cuda.current_device(), synchronize(), "
         "empty_cache() in core/utils.py, p2p_communication.py, dist-checkpointing writers"),
    Shim("CPU RNG tracker", "megatron-core", "0.16.1", _cpu_only, _patch_rng, _probe_rng,
         "tensor_parallel/random.py keeps CUDA generator states"),
    Shim("recompute under the CPU mode", "megatron-core", "0.16.1", _cpu_only,
         _patch_recompute, _probe_recompute,
         "activation recompute re-runs forward inside backward, outside the torch function mode"),
    Shim("device='cuda' to CPU mode", "megatron-core", "0.16.1", _cpu_only, _enter_cpu_mode,
         _probe_cuda_calls, "schedules.py, clip_grads.py, optimizer.py create CUDA tensors and "
         "check CUDA type strings"),
    Shim("MoE router without TE", "megatron-core", "0.16.1", _without_te, _patch_moe_router,
         _probe_moe_router, "moe_utils.py RouterGatingLinearFunction reads te_general_gemm, "
         "defined only when Transformer Engine imports: NameError in every MoE forward"),
    Shim("MLA without TE", "megatron-core", "0.16.1", _without_te, _patch_mla_te_flag,
         _probe_mla_te_flag, "multi_latent_attention.py takes the stand-ins of the TE extension "
         "for Transformer Engine (HAVE_TE) and calls isinstance on them: TypeError building "
         "every multi-latent-attention layer"),
    Shim("Adam step on fully_reshardable load", "megatron-core", "0.16.1", _applied_by_caller, None,
         _probe_adam_step, "keep_adam_step / unshare_adam_steps, around each "
         "distributed-optimizer load"),
    Shim("save-results queue warm-up", "megatron-core", "0.16.1", _applied_by_caller, None,
         _probe_results_queue, "warm_save_results_queue, started by MegatronCheckpointIO: the "
         "first save's results queue server imports torch (2 s) on the save's critical path, "
         "and dies of a stop signal sent to the process group"),
    Shim("checkpoint loads without code (DeepSpeed)", "deepspeed", "0.19.8", _applied_by_caller,
         None, _probe_deepspeed_unsafe_load, "checkpoint_loads_without_code, around every "
         "checkpoint read: TorchCheckpointEngine.load unpickles with weights_only=False"),
    Shim("checkpoint loads without code (torch DCP)", "torch", "2.13.0", _applied_by_caller,
         None, _probe_dcp_unsafe_load, "checkpoint_loads_without_code, around every "
         "checkpoint read: FileSystemReader.read_metadata calls pickle.load, "
         "DefaultLoadPlanner.load_bytes torch.load(weights_only=False)"),
    Shim("elastic agent monitor hook", "torch", "2.13.0", _applied_by_caller, None,
         _probe_elastic_monitor, "monitored_elastic_agent, around the launcher's elastic_launch: "
         "torch elastic's agent has no hook for a hang check or a restart policy by exit code, "
         "and exits 1 when the first node's agent (the rendezvous store) exits first"),
    Shim("JIT-build locks of killed ranks", "torch", "2.13.0", _applied_by_caller, None,
         _probe_jit_baton, "launcher.core.jit_locks.release_jit_build_locks, after the "
         "watchdog kills an attempt's ranks: cpp_extension._jit_compile waits forever on a "
         "FileBaton its killed owner left"),
    Shim("stale JIT-build locks", "torch", "2.13.0", _applied_by_caller, None, _probe_jit_baton,
         "launcher.core.jit_locks.take_over_stale_build_locks, at every rank's start: a lock "
         "nobody holds beside a built op makes every later build of that op wait forever"),
    Shim("no shared-memory comm op on CPU", "deepspeed", "0.19.8", _applied_by_caller, None,
         _probe_shm_build, "skip_cpu_shm_build, before deepspeed.init_distributed: TorchBackend "
         "JIT-builds deepspeed_shm_comm (inference all-reduce only) in every CPU rank"),
    Shim("eager Muon import on CPU", "deepspeed", "0.19.8", _applied_by_caller, None,
         _probe_muon_compile, "eager_muon_on_cpu: deepspeed.initialize imports Muon, whose "
         "torch.compile decorator imports Dynamo and Inductor (3 s per CPU rank)"),
    Shim("compiled task templates kept", "lm-eval", "0.4.13", _applied_by_caller, None,
         _probe_template_compiles, "compiled_templates_kept, before a run of tasks: "
         "utils.apply_template compiles the task's Jinja template again for every document"),
    Shim("no forced memory reports", "deepspeed", "0.19.8", _applied_by_caller, None,
         _probe_bf16_memory_reports, "quiet_bf16_optimizer: BF16_Optimizer forces "
         "see_memory_usage, each a gc.collect() (2.7 s of every bf16 start-up)"),
)
"""Every patch of a library internal (see the module docstring)."""


def install() -> list:
    """Apply every shim whose condition holds in this process, once; the names applied now or
    before. Call at the start of each training process (before Megatron-Core builds anything)."""
    if os.environ.get(DISABLE_TE_ENV) == "1":
        _hide_transformer_engine()
    for shim in SHIMS:
        if shim.apply is not None and shim.name not in _STATE["applied"] and shim.when():
            shim.apply()
            _STATE["applied"].append(shim.name)
    return list(_STATE["applied"])


def shape_imports() -> None:
    """What :func:`install` does on a machine without CUDA before Megatron-Core is imported
    (Transformer Engine hidden under TRAINWRIGHT_DISABLE_TE=1, Megatron-Core imported with its
    fused kernels eager), for a process that imports a CPU rank's libraries before it is one
    (:mod:`launcher.launch.rank_preload`)."""
    if os.environ.get(DISABLE_TE_ENV) == "1":
        _hide_transformer_engine()
    _eager_fusers()


def cpu_mode_active() -> bool:
    """Whether the CPU redirects are applied in this process."""
    return _STATE["mode"] is not None
