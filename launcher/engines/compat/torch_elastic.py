"""torch 2.13's elastic launcher: a hook for the launcher's own health check and restart policy,
agents that outlive the rendezvous store they poll, rendezvous events named without reading the
launcher's source; the build locks of its JIT extensions."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Optional

from launcher.engines.compat.shim import Shim, applied_by_caller


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
        with rendezvous_events_named_by_frame():
            yield
    finally:
        api.LocalElasticAgent = base


@contextlib.contextmanager
def rendezvous_events_named_by_frame() -> Iterator[None]:
    """Within the block, torch elastic's rendezvous names its events (``_record``: every join,
    heartbeat and close) from the calling frame's code, not from ``inspect.stack()``.

    torch 2.13's ``dynamic_rendezvous.get_method_name`` calls ``inspect.stack()`` twice per
    event, and that reads the source line of every frame of the stack, looking each file's module
    up among all imported ones: 40-70 ms an event in a launcher that imported torch, 0.4 s over a
    launch (seven events before the ranks start, two at exit). The name is the same: the
    function of the frame ``depth`` above it."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as rendezvous

    by_stack = rendezvous.get_method_name
    rendezvous.get_method_name = method_name
    try:
        yield
    finally:
        rendezvous.get_method_name = by_stack


def method_name(depth: int = 2) -> str:
    """What torch's ``get_method_name(depth)`` answers: the name of the function ``depth``
    frames above this one ("no_method_name" past the stack's end)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


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


def _probe_elastic_monitor() -> bool:
    import inspect

    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    loop = inspect.getsource(SimpleElasticAgent._invoke_run)
    return ("LocalElasticAgent(" in inspect.getsource(api.launch_agent)
            and "self._monitor_workers(" in loop and "self._remaining_restarts > 0" in loop
            and "rdzv_handler.num_nodes_waiting()" in loop)


def _probe_event_names_by_stack() -> bool:
    import inspect

    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as rendezvous

    return ("inspect.stack()" in inspect.getsource(rendezvous.get_method_name)
            and "get_method_name()" in inspect.getsource(rendezvous))


def _probe_jit_baton() -> bool:
    import inspect

    from torch.utils import cpp_extension

    return "baton.wait()" in inspect.getsource(cpp_extension._jit_compile)


SHIMS = (
    Shim("elastic agent monitor hook", "torch", "2.13.0", applied_by_caller, None,
         _probe_elastic_monitor, "monitored_elastic_agent, around the launcher's elastic_launch: "
         "torch elastic's agent has no hook for a hang check or a restart policy by exit code, "
         "and exits 1 when the first node's agent (the rendezvous store) exits first"),
    Shim("rendezvous event names by frame", "torch", "2.13.0", applied_by_caller, None,
         _probe_event_names_by_stack, "rendezvous_events_named_by_frame, inside "
         "monitored_elastic_agent: the rendezvous names each event through inspect.stack(), "
         "which reads the source of every frame (0.4 s of a launch, most before the ranks start)"),
    Shim("JIT-build locks of killed ranks", "torch", "2.13.0", applied_by_caller, None,
         _probe_jit_baton, "launcher.core.jit_locks.release_jit_build_locks, after the "
         "watchdog kills an attempt's ranks: cpp_extension._jit_compile waits forever on a "
         "FileBaton its killed owner left"),
    Shim("stale JIT-build locks", "torch", "2.13.0", applied_by_caller, None, _probe_jit_baton,
         "launcher.core.jit_locks.take_over_stale_build_locks, at every rank's start: a lock "
         "nobody holds beside a built op makes every later build of that op wait forever"),
)
