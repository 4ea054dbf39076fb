"""Ranks that start with their libraries already imported.

Importing torch, Megatron-Core and lm-evaluation-harness costs a rank about 5 s of CPU, and
every rank of a machine pays it at once, after the launcher has composed and checked the job.
For a short command (``launcher.evaluate``, ``launcher.generate``) that is most of its wall
time. Here the launcher starts, at its first line, multiprocessing's fork server (the
``forkserver`` start method, which torch's elastic launcher supports) with this module as its
preload: the server imports the ranks' libraries while the launcher composes and checks the job
on another core, and each rank is then a fork of the server, with nothing left to import.

What a spawned rank inherited from its launcher, a forked one gets here too:

- **the environment**: the server has the launcher's environment of the moment it started;
  each rank gets what the launcher set or removed since (:func:`launcher_env`), except what the
  elastic agent set for that rank;
- **the stop signals held**: the server starts with every stop signal held (so a stop sent to
  the process group never ends it, and its forks start with them held too); each rank takes the
  launcher's own signal mask of the moment of the launch, as a spawned rank does;
- **death with the launcher**: the server dies with the launcher (``PR_SET_PDEATHSIG``) and the
  ranks with the server (:func:`die_with_parent`, as a spawned rank dies with its launcher).

The imports are shaped as a rank's own would be (:func:`launcher.engines.compat.shape_imports`:
Transformer Engine hidden when asked, Megatron-Core's fused kernels left eager).

Only on a machine without an NVIDIA device: a fork of a process that initialised CUDA cannot use
it, and whether Transformer Engine's and Megatron-Core's imports leave CUDA untouched has not been
checked on a GPU yet; there the ranks are spawned as before. ``launcher.evaluate``,
``launcher.generate`` and ``launcher.convert`` (reshard, from_hf) use it, not ``launcher.train``:
a training rank's first line (:func:`launcher.core.stop.stop_from_first_line`, run again as
``__mp_main__`` before the rank's entry) has not been checked against a forked start.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional, Sequence

from launcher.parallel.distributed import in_distributed_launch

PRELOAD_ENV = "TRAINWRIGHT_RANK_PRELOAD"
"""Set only in the fork server's environment while it starts: the modules to import,
comma-separated."""

_started_env: Optional[dict] = None
"""In the launcher: its environment when it started the server (None: no server)."""

_server_env: Optional[dict] = None
"""In the server, and so in every rank forked from it: the environment it started with."""


def preload_rank_imports(modules: Sequence[str]) -> None:
    """Start the fork server of this machine's ranks, importing ``modules`` (and what a rank
    imports before them) in the background; :func:`start_method` then names it. Call it once,
    from the main thread, as early as the command can name its ranks' modules. Nothing when this
    process is itself a rank (torchrun, srun); a job of one rank runs in this process and leaves
    the server unused."""
    global _started_env
    if _started_env is not None or not modules or has_nvidia_device() \
            or in_distributed_launch():
        return
    import multiprocessing
    from multiprocessing import forkserver

    from launcher.core.stop import ALWAYS_STOP, start_resource_tracker_deaf_to_stops

    start_resource_tracker_deaf_to_stops()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, set(ALWAYS_STOP) | {signal.SIGUSR1})
    os.environ[PRELOAD_ENV] = ",".join(modules)
    try:
        multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
        forkserver.ensure_running()
    finally:
        del os.environ[PRELOAD_ENV]
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    _started_env = dict(os.environ)


def start_method() -> str:
    """The start method of this launcher's ranks: the preloaded fork server, else spawn."""
    return "forkserver" if _started_env is not None else "spawn"


def launcher_env() -> tuple[dict, list]:
    """(variables the launcher set or changed since it started the server, variables it
    removed); nothing without a server."""
    if _started_env is None:
        return {}, []
    now = dict(os.environ)
    changed = {k: v for k, v in now.items() if _started_env.get(k) != v}
    return changed, [k for k in _started_env if k not in now]


def as_launched(entrypoint: Callable, changed: dict, removed: list, mask: set, *args):
    """A rank's entry: the launcher's environment and signal mask of the launch (module
    docstring), then ``entrypoint(*args)``. Variables the elastic agent set for this rank win."""
    own = {k for k, v in os.environ.items() if _server_env is not None
           and _server_env.get(k) != v}
    for key in removed:
        if key not in own:
            os.environ.pop(key, None)
    os.environ.update({k: v for k, v in changed.items() if k not in own})
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return entrypoint(*args)


def _serve() -> None:
    """In the fork server: die with the launcher, then the imports (a failure is one line;
    the ranks then import what is missing themselves)."""
    global _server_env
    modules = os.environ.pop(PRELOAD_ENV).split(",")
    _server_env = dict(os.environ)
    die_with_parent()
    try:
        from launcher.engines.compat import shape_imports

        shape_imports()
        for module in modules:
            __import__(module)
    except Exception as exc:  # a rank imports it again and meets the error where it is reported
        print(f"launcher: rank preload stopped: {type(exc).__name__}: {exc}", file=sys.stderr)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (a rank's launcher or fork server, the
    server's launcher) dies (``prctl(PR_SET_PDEATHSIG)``); nothing elsewhere."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def has_nvidia_device() -> bool:
    """Whether this machine shows a rank an NVIDIA GPU, decided without initialising CUDA."""
    import glob

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return bool(glob.glob("/dev/nvidia[0-9]*")) and visible not in ("", "-1")


if os.environ.get(PRELOAD_ENV):
    _serve()
