"""Start this machine's ranks of a world (:func:`launch_world`): torch's elastic launcher, a c10d
rendezvous on localhost for a world of one machine, or the job's rendezvous when this process is
a node's agent (:class:`Rendezvous`); stop signals are forwarded to the ranks and the launcher
exits with the code of the rank that failed first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from launcher.core.stop import (LAUNCHER_PID_ENV, StartupStop, StopRequest, child_ranks,
                                elastic_signals, start_resource_tracker_deaf_to_stops,
                                this_process_stop)
from launcher.launch.rank_preload import (as_launched, launcher_env, start_method,
                                          wait_until_preloaded)
from launcher.parallel.distributed import free_port

if TYPE_CHECKING:
    from launcher.launch.watchdog import JobWatch


def failure_exit_code(exc) -> tuple[int, int, str]:
    """(rank, exit code, description) of the root failure of a ChildFailedError.

    A worker that exited by itself with a code > 0 wins over ranks the agent killed afterwards
    (negative codes = signals); among those the earliest wins, and at equal times a deliberate
    ``SystemExit`` (no error file) wins over an exception. A death by signal N becomes 128 + N.
    """
    failures = exc.failures
    own = {rank: f for rank, f in failures.items() if f.exitcode > 0}
    pool = own or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, os.path.isfile(pool[r].error_file), r))
    failure = pool[rank]
    code = failure.exitcode if failure.exitcode > 0 else 128 + (-failure.exitcode or 1)
    how = f"exit code {failure.exitcode}" if failure.exitcode > 0 \
        else f"signal {failure.signal_name()}"
    return rank, code, f"rank {rank} failed with {how} (error file: {failure.error_file})"


@dataclass(frozen=True)
class Rendezvous:
    """Where the agents of a world meet (torch elastic's c10d rendezvous): one agent per
    machine, ``nnodes`` of them."""

    nnodes: int
    endpoint: str
    """host:port of the rendezvous (the first node hosts it)."""
    run_id: str
    """The same on every agent (the job id)."""
    local_addr: Optional[str] = None
    """The address the other agents reach this one at (None: the host name)."""
    nproc_per_node: int = 0
    """Ranks each agent starts, as the job script says (0: the config's, unchecked)."""

    @classmethod
    def local(cls) -> "Rendezvous":
        """A world of this machine alone, on a free port of the loopback interface."""
        return cls(1, f"127.0.0.1:{free_port()}", f"tw-{uuid.uuid4().hex[:8]}", "127.0.0.1")

    def to_env(self) -> dict:
        """The variables that hand this rendezvous to a ``launcher.<command>`` process."""
        return {AGENT_ENV: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Optional["Rendezvous"]:
        """The rendezvous a per-node agent handed this process, or None."""
        return cls(**json.loads(env[AGENT_ENV])) if env.get(AGENT_ENV) else None


AGENT_ENV = "TRAINWRIGHT_AGENT_RENDEZVOUS"
"""Set by ``launcher.launch.agent``: this process is a node's agent, its ranks join that
rendezvous (:meth:`Rendezvous.from_env`)."""


def launch_world(entrypoint: Callable, args: tuple, nprocs: int, rendezvous: Rendezvous,
                 log_dir: Optional[Path] = None, stop_signal: str = "SIGUSR1",
                 watch: Optional["JobWatch"] = None) -> None:
    """Run ``entrypoint(*args)`` in ``nprocs`` worker processes on this machine, as one agent of
    ``rendezvous``, and wait.

    Uses torch's elastic launcher with a c10d rendezvous; workers see RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT as under torchrun. ``entrypoint`` must be picklable (a
    module-level function; workers are spawned). With ``log_dir`` each worker's stdout/stderr
    go to files there (``<log_dir>/<run_id>_*/attempt_0/<rank>/``).

    If any worker fails, prints which one to stderr and raises ``SystemExit`` with that worker's
    exit code (so REQUEUE_EXIT from a worker becomes the launcher's exit code).

    While the workers run, a stop signal (:func:`launcher.core.stop.stop_signals`) sent to
    this process is forwarded to the workers, whose StopRequest saves and exits with
    REQUEUE_EXIT, which is passed on; sent to the whole process group, the workers get it
    directly and the forwarded copy changes nothing. Other terminating signals (SIGHUP,
    SIGQUIT) make the elastic agent stop the workers and this raise ``SystemExit`` with 128 +
    the signal number.

    With ``watch`` (:class:`launcher.launch.watchdog.JobWatch`) the ranks publish heartbeats,
    hangs are detected, and the agent restarts the whole worker group after a failure up to
    ``watch.resilience.restarts_in_job`` times (torch elastic's ``max_restarts``); when the job
    fails for good every attempt's cause is printed.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from launcher.engines.compat import monitored_elastic_agent

    logs = DefaultLogsSpecs(log_dir=str(log_dir) if log_dir else None,
                            redirects=Std.ALL if log_dir else Std.NONE)
    r = rendezvous
    config = LaunchConfig(
        min_nodes=r.nnodes, max_nodes=r.nnodes, nproc_per_node=nprocs, run_id=r.run_id,
        role="trainer", rdzv_backend="c10d", rdzv_endpoint=r.endpoint,
        max_restarts=watch.resilience.restarts_in_job if watch else 0,
        monitor_interval=0.1, start_method=start_method(), local_addr=r.local_addr,
        logs_specs=logs,
        signals_to_handle=elastic_signals(stop_signal))
    wait_until_preloaded()  # a stop meanwhile ends this process at once (no ranks yet)
    with stops_forwarded(stop_signal) as stops:
        if watch is not None:
            watch.stops = stops
        monitor = watch if watch is not None else forward_to_late_ranks(stops)
        try:
            with monitored_elastic_agent(monitor), heartbeats_for(watch):
                elastic_launch(config, as_launched)(entrypoint, *launcher_env(),
                                                     signal.pthread_sigmask(signal.SIG_BLOCK, ()),
                                                     *args)
        except ChildFailedError as exc:
            code, message = failure_verdict(exc, watch)
            print(f"launcher: {message}; exiting with {code}", file=sys.stderr, flush=True)
            raise SystemExit(code) from exc
        except SignalException as exc:
            print(f"launcher: received {exc.sigval.name}; workers stopped", file=sys.stderr,
                  flush=True)
            raise SystemExit(128 + int(exc.sigval)) from exc


def failure_verdict(exc, watch: Optional["JobWatch"]) -> tuple[int, str]:
    """The exit code of a launch whose ranks failed, and the line that says why: the watch's
    verdict (a stop of the job's, a final cause, every attempt) over the agent's report."""
    rank, code, message = failure_exit_code(exc)
    if watch is not None and watch.stopped() is not None:
        return watch.stopped()
    verdict = watch.verdict() if watch is not None else None
    if verdict is not None and verdict != (rank, code):
        rank, code = verdict
        message = f"rank {rank} failed with exit code {code} (the watch stopped the others)"
    if watch is not None and watch.attempts and watch.attempts[-1].final:
        message = f"{message}; not restarting: {watch.attempts[-1].final}"
    if watch is not None and len(watch.attempts) > 1:
        message = f"{message}; {len(watch.attempts)} attempts: {watch.summary()}"
    return code, message


@contextlib.contextmanager
def stops_forwarded(stop_signal: str):
    """While this process's ranks run: a stop signal it receives is recorded and sent on to them
    (:meth:`StartupStop.forward_to`; the one installed at the command's first line, else one of
    its own for this block), and its ranks know it as their launcher
    (:data:`launcher.core.stop.LAUNCHER_PID_ENV`: a spawned rank of ``launcher.train`` installs
    its own stop handling while Python imports its main module). Yields the
    :class:`StartupStop`, whose ``received`` says whether the job was asked to stop."""
    early = this_process_stop()
    request, stops = early if early is not None else (StopRequest(stop_signal), None)
    request.watch_also(stop_signal)
    if stops is None:
        stops = StartupStop(stop_signal, None, request=request)
    stops.watch_also(stop_signal)
    stops.forward_to(child_ranks)
    start_resource_tracker_deaf_to_stops(stop_signal)
    before = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        yield stops
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = before
        stops.record_only()
        if early is None:
            stops.finish()
            request.restore()


def forward_to_late_ranks(stops):
    """The elastic agent's monitor of a launch with no watch: a stop that arrived before a rank
    was spawned is sent to it after."""
    def monitor(agent, worker_group, result):
        stops.forward_late()
        return result

    return monitor


@contextlib.contextmanager
def heartbeats_for(watch: Optional["JobWatch"]):
    """While the ranks run: the folder of their heartbeats (in shared memory when the machine
    has /dev/shm), handed to them through the environment they inherit; removed after."""
    from launcher.runtime.heartbeat import HEARTBEAT_DIR_ENV

    if watch is None:
        yield
        return
    added = {HEARTBEAT_DIR_ENV: str(watch.heartbeat_dir), **flight_recorder_env(watch.run_dir)}
    added = {k: v for k, v in added.items() if k == HEARTBEAT_DIR_ENV or k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
        shutil.rmtree(watch.heartbeat_dir, ignore_errors=True)


def flight_recorder_env(run_dir: Optional[Path]) -> dict:
    """PyTorch's NCCL flight recorder for the ranks (GPU runs; the variables do nothing on
    gloo): the last 2,000 collectives of each rank, dumped on a collective timeout or a hang
    of the NCCL watchdog to ``<run_dir>/hangs/nccl_trace_rank_<r>`` (read them with
    ``python -m torch.distributed.flight_recorder.fr_trace``). Variables already set win; none
    without CUDA."""
    import torch

    if run_dir is None or not torch.cuda.is_available():
        return {}
    (Path(run_dir) / "hangs").mkdir(parents=True, exist_ok=True)
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(Path(run_dir) / "hangs" / "nccl_trace_rank_")}


def launch_local_world(entrypoint: Callable, args: tuple, nprocs: int, run_id: str,
                       log_dir: Optional[Path] = None, stop_signal: str = "SIGUSR1") -> None:
    """:func:`launch_world` on this machine alone (a loopback rendezvous named ``run_id``)."""
    rendezvous = dataclasses.replace(Rendezvous.local(), run_id=run_id)
    launch_world(entrypoint, args, nprocs, rendezvous, log_dir=log_dir, stop_signal=stop_signal)
