"""The local multi-process launcher: ``python -m launcher.train`` on one machine starts its ranks
here (torch's elastic launcher, a c10d rendezvous on localhost), forwards stop signals to them and
exits with the code of the rank that failed first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Optional

from launcher.core.stop import child_ranks, elastic_signals, forward_stop_signals, restore_handlers
from launcher.parallel.distributed import free_port


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


def launch_local_world(entrypoint: Callable, args: tuple, nprocs: int, run_id: str,
                       log_dir: Optional[Path] = None, stop_signal: str = "SIGUSR1") -> None:
    """Run ``entrypoint(*args)`` in ``nprocs`` worker processes on this machine and wait.

    Uses torch's elastic launcher with a c10d rendezvous on 127.0.0.1 at a free port; workers see
    RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as under torchrun. ``entrypoint`` must
    be picklable (a module-level function; workers are spawned). With ``log_dir`` each worker's
    stdout/stderr go to files there (``<log_dir>/<run_id>_*/attempt_0/<rank>/``).

    If any worker fails, prints which one to stderr and raises ``SystemExit`` with that worker's
    exit code (so REQUEUE_EXIT from a worker becomes the launcher's exit code).

    While the workers run, a stop signal (:func:`launcher.core.stop.stop_signals`) sent to
    this process is forwarded to the workers, whose StopRequest saves and exits with
    REQUEUE_EXIT, which is passed on; sent to the whole process group, the workers get it
    directly and the forwarded copy changes nothing. Other terminating signals (SIGHUP,
    SIGQUIT) make the elastic agent stop the workers and this raise ``SystemExit`` with 128 +
    the signal number.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logs = DefaultLogsSpecs(log_dir=str(log_dir) if log_dir else None,
                            redirects=Std.ALL if log_dir else Std.NONE)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=run_id, role="trainer",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn", local_addr="127.0.0.1", logs_specs=logs,
        signals_to_handle=elastic_signals(stop_signal))
    previous = forward_stop_signals(stop_signal, child_ranks)
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        rank, code, message = failure_exit_code(exc)
        print(f"launch_local_world: {message}; exiting with {code}", file=sys.stderr, flush=True)
        raise SystemExit(code) from exc
    except SignalException as exc:
        print(f"launch_local_world: received {exc.sigval.name}; workers stopped",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + int(exc.sigval)) from exc
    finally:
        restore_handlers(previous)
