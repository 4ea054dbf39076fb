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
  ranks with the server (:func:`launcher.core.stop.die_with_parent`, as a spawned rank dies
  with its launcher);
- **the stop contract of its first line**: a spawned rank of ``launcher.train`` installs its
  start-up stop handling while Python imports its main module
  (:func:`launcher.core.stop.stop_from_first_line`). A forked rank imports it too, but under the
  server as its parent it cannot tell itself from a helper process there; :func:`as_launched`
  installs it once the rank has its launcher's environment, while the stop signals are still
  held, so none is lost; the launcher forwards a stop it alone receives to its server's children
  (:func:`launcher.core.stop.child_ranks`);
- **its threads**: torch's intra-op threads as the launcher's OMP_NUM_THREADS says at launch
  (the server's OpenMP read it at import);
- **its import chatter in its log**: what the libraries print while imported (Megatron-Core's
  warnings) the server keeps, and each rank writes it where its library output goes (its rank
  log, or the console under ``run.verbose``), not on the launcher's console; the launcher's main
  module is dropped after the imports, so the rank's run of it as ``__mp_main__`` draws no runpy
  warning.

A rank that builds an optimizer names ``torch._dynamo`` too: torch.optim's
``Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo``, which imports TorchDynamo at
the first optimizer a process builds (about 2.5 s of CPU on the 2-core EPYC, in every rank at
once). Megatron-Core's import no longer brings it in (its fused kernels are left eager, below).

The imports are shaped as a rank's own would be (:func:`launcher.engines.compat.shape_imports`:
Transformer Engine hidden when asked, Megatron-Core's fused kernels left eager).

Only on a machine without an NVIDIA device: a fork of a process that initialised CUDA cannot use
it, and whether Transformer Engine's and Megatron-Core's imports leave CUDA untouched has not been
checked on a GPU yet; there the ranks are spawned as before (and anywhere under
``TRAINWRIGHT_SPAWN_RANKS=1``). ``launcher.train`` (not a sweep's points), ``launcher.evaluate``,
``launcher.generate`` and ``launcher.convert`` (reshard, from_hf) use it; ``launcher.probe`` does
not (it measures a training start-up as spawned ranks pay it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from launcher.core.stop import die_with_parent, first_line_of_forked_rank
from launcher.parallel.distributed import in_distributed_launch

PRELOAD_ENV = "TRAINWRIGHT_RANK_PRELOAD"
"""Set only in the fork server's environment while it starts: the modules to import,
comma-separated."""

SPAWN_RANKS_ENV = "TRAINWRIGHT_SPAWN_RANKS"
"""=1: no fork server; every rank is spawned and imports its libraries itself (as on a machine
with an NVIDIA device; ``bench/startup.py --spawned`` compares the two)."""

READY_ENV = "TRAINWRIGHT_RANK_PRELOAD_READY"
"""Set only in the fork server's environment while it starts: the file it writes to once its
imports are done (:func:`wait_until_preloaded`)."""

MAIN_ENV = "TRAINWRIGHT_RANK_PRELOAD_MAIN"
"""Set only in the fork server's environment while it starts: the launcher's main module."""

_import_output = ""
"""In the server, and so in every rank forked from it: what its imports printed."""

_ready_file: Optional[str] = None
"""In the launcher: that file, until it has waited for it."""

_started_env: Optional[dict] = None
"""In the launcher: its environment when it started the server (None: no server)."""

_server_env: Optional[dict] = None
"""In the server, and so in every rank forked from it: the environment it started with."""


def preload_rank_imports(modules: Sequence[str]) -> None:
    """Start the fork server of this machine's ranks, importing ``modules`` (and what a rank
    imports before them) in the background; :func:`start_method` then names it. Call it once,
    from the main thread, as early as the command can name its ranks' modules. Nothing when this
    process is itself a rank (torchrun, srun); a job of one rank runs in this process and ends
    the server (:func:`stop_unused_server`)."""
    global _started_env, _ready_file
    if _started_env is not None or not modules or has_nvidia_device() \
            or in_distributed_launch() or os.environ.get(SPAWN_RANKS_ENV) == "1":
        return
    import multiprocessing
    from multiprocessing import forkserver

    from launcher.core.stop import ALWAYS_STOP, start_resource_tracker_deaf_to_stops

    start_resource_tracker_deaf_to_stops()
    fd, _ready_file = tempfile.mkstemp(prefix="trainwright-preload-", suffix=".ready")
    os.close(fd)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, set(ALWAYS_STOP) | {signal.SIGUSR1})
    main = getattr(sys.modules["__main__"], "__spec__", None)
    os.environ[PRELOAD_ENV] = ",".join(modules)
    os.environ[READY_ENV], os.environ[MAIN_ENV] = _ready_file, main.name if main else ""
    try:
        multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
        forkserver.ensure_running()
    finally:
        del os.environ[PRELOAD_ENV], os.environ[READY_ENV], os.environ[MAIN_ENV]
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    _started_env = dict(os.environ)


def wait_until_preloaded(poll_s: float = 0.02) -> None:
    """Wait until the fork server has imported the ranks' libraries (or died); nothing
    without a server. Call it before the ranks are started: the server forks no rank
    before its imports are done, so a launcher that asked for ranks earlier would sit in that
    request, deaf to a stop, until they were; waiting here instead, the launcher is still before
    its ranks, where a stop ends it at once (:func:`launcher.core.stop.stop_from_first_line`)."""
    if _ready_file is None:
        return
    from multiprocessing import forkserver

    import psutil

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    try:
        while os.path.getsize(_ready_file) == 0 and pid and psutil.pid_exists(pid):
            time.sleep(poll_s)
    finally:
        _drop_ready_file()


def _drop_ready_file() -> None:
    """Remove the server's ready file (:func:`wait_until_preloaded`) and forget it."""
    global _ready_file
    if _ready_file is not None:
        with contextlib.suppress(OSError):
            os.unlink(_ready_file)
    _ready_file = None


def stop_unused_server() -> None:
    """End the fork server of a job whose one rank runs in this process: nothing will be forked
    from it, and its imports (about 5 s of CPU) would take a core from the rank's own. Killed,
    not asked to stop (it reads its stop request only once its imports are done), then reaped
    through multiprocessing's own clean-up (``ForkServer._stop``, CPython 3.11), which forgets
    it, so a later fork request starts a new server rather than reaping a dead one."""
    global _started_env
    if _started_env is None:
        return
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        server._stop()
    _drop_ready_file()
    _started_env = None


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
    if _server_env is not None:
        first_line_of_forked_rank()
        _threads_as_launched(changed)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return entrypoint(*args)


def _threads_as_launched(changed: dict) -> None:
    """torch's intra-op threads as OMP_NUM_THREADS says now: the server's OpenMP read the
    variable when torch was imported, before the launcher changed it."""
    threads = changed.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _serve() -> None:
    """In the fork server: die with the launcher, then the imports (a failure is one line;
    the ranks then import what is missing themselves)."""
    global _server_env
    modules = os.environ.pop(PRELOAD_ENV).split(",")
    ready, main = os.environ.pop(READY_ENV, ""), os.environ.pop(MAIN_ENV, "")
    _server_env = dict(os.environ)
    die_with_parent()
    try:
        with _import_output_kept():  # its fds are the console again when the except runs
            from launcher.engines.compat import shape_imports

            shape_imports()
            for module in modules:
                __import__(module)
            # A rank runs the command's module again as its __mp_main__; found imported, runpy
            # warns on the rank's console. What it imports stays imported.
            sys.modules.pop(main, None)
    except Exception as exc:  # a rank imports it again and meets the error where it is reported
        print(f"launcher: rank preload stopped: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
    finally:
        if ready:
            with contextlib.suppress(OSError), open(ready, "a") as done:
                done.write("imported\n")


@contextlib.contextmanager
def _import_output_kept():
    """This process's stdout and stderr (fds 1 and 2) into a file while the block runs, its
    text then in :data:`_import_output`. The libraries' import-time chatter (Megatron-Core's
    warnings) is a rank's library output, which goes to the rank's log (:func:`import_output`),
    not the console."""
    global _import_output
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            _import_output = sink.read().decode("utf-8", "replace")


def import_output() -> str:
    """In a rank forked from the server: what the server's imports printed (each rank writes it
    where its library output goes, as a spawned rank's own imports would); '' elsewhere."""
    return _import_output


def has_nvidia_device() -> bool:
    """Whether this machine shows a rank an NVIDIA GPU, decided without initialising CUDA."""
    import glob

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return bool(glob.glob("/dev/nvidia[0-9]*")) and visible not in ("", "-1")


if os.environ.get(PRELOAD_ENV):
    _serve()
