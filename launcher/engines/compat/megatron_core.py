"""Megatron-Core 0.16.1 patches on any machine: two sites that break without Transformer Engine,
the distributed optimizer's Adam step on a load, and the save-results queue of its asynchronous
checkpoint writer; each beside the probe that says the library still needs it."""

from __future__ import annotations

import contextlib

import torch

from launcher.core.stop import rank_helper
from launcher.engines.compat.shim import Shim, applied_by_caller
from launcher.engines.compat.transformer_engine import without_te


def _patch_moe_router() -> None:
    """transformer/moe/moe_utils.py RouterGatingLinearFunction reads te_general_gemm, which is only
    defined when Transformer Engine imports (NameError in every MoE forward without TE)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _probe_moe_router() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm")


def _patch_mla_te_flag() -> None:
    """transformer/multi_latent_attention.py sets HAVE_TE when its import of
    megatron.core.extensions.transformer_engine succeeds, which it does without Transformer
    Engine (stand-in classes), then calls isinstance(x, TELinear) on a stand-in: TypeError
    building any multi-latent-attention layer."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def _probe_mla_te_flag() -> bool:
    from megatron.core.transformer import multi_latent_attention as mla

    return mla.HAVE_TE and not isinstance(mla.TELinear, type)


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


def _probe_adam_step() -> bool:
    """The fully-reshardable load still leaves ``step`` out (see :func:`keep_adam_step`)."""
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return hasattr(DistributedOptimizer, "_set_main_param_and_optimizer_states") and \
        "load_parameter_state_from_fully_reshardable" in inspect.getsource(DistributedOptimizer)


def start_save_results_queue(stop_signal: str = "SIGUSR1") -> None:
    """Create Megatron-Core's save-results queue with a server forked from this rank (once per
    process; call it from the rank's main thread, before the model is built), deaf to the stop
    signals (``stop_signal``: the run's ``trainer.stop_signal``).

    Megatron-Core 0.16.1 (``strategies/filesystem_async._get_write_results_queue``) hands every
    save's write results back through a ``Manager().Queue()`` whose server it *spawns* at the
    first save. That server is a fresh interpreter which imports torch when it unpickles the
    first results, on the first save's path (2.4 s of a two-rank ``launcher.convert from_hf`` of
    9.5 s on the 2-core machine, and 2.7 s of CPU a rank taken from training), and which a stop
    signal sent to the process group kills (the save the signal asked for then failed). The
    server forked here has torch already, ignores stop signals and dies with its rank
    (:func:`launcher.core.stop.rank_helper`: a fork holds the rank's sockets). Forked before the
    model exists, it shares none of the pages that training rewrites (a fork after would keep
    their old copies). The modules its unpickling needs are imported first, so the fork takes no
    half-done import of another thread."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    import torch.distributed.checkpoint.filesystem  # noqa: F401 (the results' classes)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=rank_helper, initargs=(stop_signal,))
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def _probe_results_queue() -> bool:
    """Save results still come back through a queue of a Manager that the first save spawns,
    whose server keeps the default signal handlers."""
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    source = inspect.getsource(filesystem_async._get_write_results_queue)
    return filesystem_async._results_queue is None and "Manager()" in source \
        and "initializer" not in source


SHIMS = (
    Shim("MoE router without TE", "megatron-core", "0.16.1", without_te, _patch_moe_router,
         _probe_moe_router, "moe_utils.py RouterGatingLinearFunction reads te_general_gemm, "
         "defined only when Transformer Engine imports: NameError in every MoE forward"),
    Shim("MLA without TE", "megatron-core", "0.16.1", without_te, _patch_mla_te_flag,
         _probe_mla_te_flag, "multi_latent_attention.py takes the stand-ins of the TE extension "
         "for Transformer Engine (HAVE_TE) and calls isinstance on them: TypeError building "
         "every multi-latent-attention layer"),
    Shim("Adam step on fully_reshardable load", "megatron-core", "0.16.1", applied_by_caller, None,
         _probe_adam_step, "keep_adam_step / unshare_adam_steps, around each "
         "distributed-optimizer load"),
    Shim("save-results queue server", "megatron-core", "0.16.1", applied_by_caller, None,
         _probe_results_queue, "start_save_results_queue, called by the Megatron engine's "
         "builder: the first save's spawned results-queue server imports torch (2.4 s) on the "
         "save's path, and dies of a stop signal sent to the process group"),
)
