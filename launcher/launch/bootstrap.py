"""One process bootstrap: how every command that runs on ranks starts them (:func:`run_ranks`).

``launcher.train``, ``launcher.convert from_hf`` and ``launcher.generate`` each prepare one
:class:`~launcher.launch.job.Job` (composed and planned once, in the launching process) and a
rank body, a module-level function ``body(rank: Rank) -> int``. :func:`run_ranks` then runs the
body on every rank of the job:

* in this process, when it already is a rank (started by torchrun or ``srun``) or when the job
  has one process;
* else in ``job.local_ranks`` processes it spawns on this machine (torch elastic:
  :func:`launcher.launch.local.launch_world`), handing each the same Job: a world of this
  machine alone (c10d on localhost), or this node's share of a multi-node world when this
  process is the node's agent (``launcher.launch.agent``, which hands it the job's
  rendezvous).

Every rank starts the same way (:func:`start_rank`): its library output goes to
``<run_dir>/logs/rank_<r>.log`` (unless ``run.verbose``), the stop contract is installed
(:class:`launcher.core.stop.StopRequest`: a stop signal only sets a flag that the ranks agree on
at a safe point), the libraries are patched (:mod:`launcher.engines.compat`), the process group
and Megatron-Core's parallel state are set up for the plan's layout, and its pid is written to
``<run_dir>/logs/rank_<r>.pid``. Whatever the body returns or raises, the rank closes the same
way (:meth:`Rank.close`). The launching process exits with the failing rank's exit code: 75
when the ranks stopped for requeue, 128 + N when a signal N ended them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from launcher.core.atomic import atomic_write_text
from launcher.core.errors import CheckpointError
from launcher.core.exits import CONFIG_ERROR_EXIT, REQUEUE_EXIT
from launcher.core.jit_locks import take_over_stale_build_locks
from launcher.core.stop import StartupStop, StopRequest, die_with_parent, this_process_stop
from launcher.launch.agent import exit_without_collecting
from launcher.launch.job import Job
from launcher.launch.local import Rendezvous, launch_world
from launcher.launch.rank_preload import import_output, stop_unused_server
from launcher.launch.watchdog import JobWatch
from launcher.parallel.distributed import in_distributed_launch, launch_rank
from launcher.plan.resilience import collective_timeout_s
from launcher.runtime.heartbeat import STARTUP, Heartbeat
from launcher.runtime.startup import StartupClock
from launcher.runtime.console import (Console, library_logs_to, one_line, report_crash,
                                      route_output)

STOPPED_EXIT_BASE = 128
"""A command that trains nothing and is stopped by signal N exits 128 + N (the shell's code)."""


@dataclass
class Rank:
    """One started rank of a job: what a rank body gets."""

    job: Job
    rank: int
    """Global rank."""
    world: int
    """Ranks in all."""
    stop: StopRequest
    """The stop contract of this rank: ``stop.agree()`` at each safe point (a collective)."""
    console: Console
    """Where the command's own lines go (the terminal, while library output goes to the log)."""
    heartbeat: Optional[Heartbeat] = None
    """This rank's progress for its launcher's hang watchdog (None: not watched)."""
    startup: Optional[StartupStop] = None
    """While the rank starts up, a stop signal ends it at once (None: stops wait for a safe
    point; commands other than train); :meth:`started` hands stops to the step contract."""
    clock: Optional[StartupClock] = None
    """Where this rank's start-up went (marked by the command's body)."""
    decided: Optional[int] = None
    """The exit code of the first cause this rank decided to end on (None: none yet): a
    failure while reporting it (a log on the same full disk) never changes it."""

    def decide(self, code: int) -> int:
        """This rank ends with ``code``, unless it has decided already; the code it ends with.
        The launcher's watch reads it from the heartbeat, so that a final cause on any rank
        (exit 2, 3, 75) is never restarted, whichever rank's exit it sees first."""
        if self.decided is None:
            self.decided = code
            self.started()  # a stop signal now must not replace the decided code
            if self.heartbeat is not None:
                self.heartbeat.exiting(code)
        return self.decided

    def started(self) -> None:
        """Start-up is over (the first step is next): a stop now saves at a step boundary."""
        if self.startup is not None:
            self.startup.finish()

    def stopped_exit(self) -> int:
        """The exit code of a command that trains nothing and stopped on a signal."""
        return STOPPED_EXIT_BASE + int(self.stop.signal_received or 15)

    def close(self) -> None:
        """Leave the process group; put the signal handlers back, unless the ranks agreed to
        stop (a stopping rank ignores further stop signals until it has exited)."""
        from launcher.parallel.distributed import destroy_distributed

        self.started()
        if not self.stop.decided:
            self.stop.restore()
        if self.heartbeat is not None:
            self.heartbeat.close()
        end_child_processes()
        destroy_distributed()


def end_child_processes() -> None:
    """Kill what this rank started and still runs: DataLoader workers (which ignore stop
    signals, so the interpreter's exit, which terminates and then joins them, would wait
    forever after a failure left their iterator open) and library helper processes."""
    import multiprocessing
    import signal

    children = multiprocessing.active_children()
    if children:  # torch's SIGCHLD handler would raise "DataLoader worker ... is killed"
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)


RankBody = Callable[[Rank], int]
"""A command's work on one rank; returns the rank's exit code."""


def run_ranks(job: Job, body: RankBody, *, command: str, resilient: bool = False) -> int:
    """Run ``body`` on every rank of ``job`` (see the module docstring); the exit code. With
    ``resilient`` (training) the ranks this process starts are watched for hangs and restarted
    after a failure (:mod:`launcher.launch.watchdog`, the ``resilience`` group)."""
    nodes, agent = job.cfg.cluster.nodes, Rendezvous.from_env()
    startup_exit = REQUEUE_EXIT if resilient else None
    if in_distributed_launch() or (nodes == 1 and job.local_ranks == 1 and agent is None):
        stop_unused_server()
        return on_this_rank(job, body, command, startup_exit)
    problem = _launch_problem(job, agent)
    if problem:
        print(f"{command}: {problem}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    log = None if job.cfg.run.verbose or job.run_dir is None \
        else job.run_dir / "logs" / "launcher.log"
    watch = job_watch(job) if resilient else None
    with library_logs_to(log):
        launch_world(_spawned_rank, (job, body, command, startup_exit), job.local_ranks,
                     agent or Rendezvous.local(), stop_signal=job.cfg.trainer.stop_signal,
                     watch=watch)
    return 0


def job_watch(job: Job) -> JobWatch:
    """The watch over this machine's ranks of ``job``; heartbeats in shared memory."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    folder = Path(tempfile.mkdtemp(prefix="trainwright-heartbeats-", dir=shm))
    return JobWatch(resilience=job.cfg.resilience, heartbeat_dir=folder, run_dir=job.run_dir)


def _launch_problem(job: Job, agent: Optional[Rendezvous]) -> str:
    """Why this process cannot start the job's ranks here ('' when it can)."""
    nodes = job.cfg.cluster.nodes
    if agent is None and nodes > 1:
        return (f"cluster.nodes={nodes} needs a multi-node launcher (srun or one "
                "launcher.launch.agent per node, e.g. launcher.submit); this process starts "
                "ranks on one machine only")
    if agent is not None and (agent.nnodes, agent.nproc_per_node or job.local_ranks) != \
            (nodes, job.local_ranks):
        return (f"the agent starts {agent.nproc_per_node} rank(s) on each of {agent.nnodes} "
                f"node(s), the config plans {job.local_ranks} on each of {nodes} "
                "(cluster.nodes, gpus_per_node, ranks_per_gpu); launch with the config's layout")
    return ""


def _spawned_rank(job: Job, body: RankBody, command: str,
                  startup_exit: Optional[int] = None) -> None:
    """Entry of a spawned rank (module level, so it pickles): exit with the body's code. The
    rank dies with its launcher (a launcher killed outright cannot stop its ranks itself)."""
    die_with_parent()
    code = on_this_rank(job, body, command, startup_exit, announce=False)
    exit_without_collecting()

    if code:
        raise SystemExit(code)


def on_this_rank(job: Job, body: RankBody, command: str,
                 startup_exit: Optional[int] = None, announce: bool = True) -> int:
    """Start this process as a rank of ``job``, run ``body``, close; the body's exit code. A
    checkpoint that cannot be used ends the rank with its message and exit code; any other
    crash is one console line, its traceback in the rank log. Once the rank has decided its
    exit code (:meth:`Rank.decide`), a failure while reporting or closing adds at most one line
    and keeps that code. With ``startup_exit``, a stop signal before the body calls
    :meth:`Rank.started` ends the rank at once with that code (:class:`StartupStop`), with one
    line from rank 0 when ``announce`` (a spawned rank's launcher says it for the job)."""
    rank = start_rank(job, command, startup_exit, announce)
    try:
        return rank.decide(body(rank))
    except CheckpointError as exc:  # says what is wrong and what to do: no traceback
        code = rank.decide(exc.exit_code)
        rank.console.error(f"{command}: rank {rank.rank}: {exc}")
        return code
    except Exception as exc:
        if rank.decided is None:
            report_crash(rank.console, rank.rank, exc, command)
            raise
        rank.console.error(f"{command}: rank {rank.rank}: then, while reporting it: "
                           f"{one_line(exc)}")
        return rank.decided
    finally:
        closing(rank, command)


def closing(rank: Rank, command: str) -> None:
    """Close the rank; once it has decided its exit code, a failure here is one line. Its
    streams are flushed (diverted when the log cannot take them), so that the interpreter's exit
    does not change the code."""
    try:
        rank.close()
    except Exception as exc:
        if rank.decided is None:
            raise
        rank.console.error(f"{command}: rank {rank.rank}: then, while closing: {one_line(exc)}")
    finally:
        rank.console.settle()


def start_rank(job: Job, command: str = "", startup_exit: Optional[int] = None,
               announce: bool = True) -> Rank:
    """Output routing, the stop contract (with ``startup_exit``, a stop during start-up ends
    the rank at once with that code; stop signals held since the spawn are delivered once it is
    in place), library patches, process group and parallel state."""
    from launcher.engines import compat
    from launcher.engines.model import init_parallel_state
    from launcher.parallel import collectives
    from launcher.parallel.distributed import init_distributed
    from launcher.runtime import strict_devices

    cfg = job.cfg
    clock = StartupClock.start(job.launched_at or None)
    clock.mark("imports")
    console = route_output(job.run_dir, launch_rank(), cfg.run.verbose) \
        if job.run_dir is not None else Console(sys.stdout, sys.stderr)
    if import_output():  # a forked rank: its libraries' import chatter, printed by the server
        print(import_output(), end="", file=sys.stderr, flush=True)
    heartbeat = Heartbeat.from_env(launch_rank(), cfg.resilience)
    if heartbeat is not None:
        heartbeat.phase(STARTUP)
    on_stop = _stopped_in_startup(console, command, startup_exit, heartbeat, announce)
    stop, startup = _stop_contract(cfg.trainer.stop_signal, startup_exit, on_stop)
    stop.agree_through(collectives.any_rank)
    take_over_stale_build_locks()
    compat.install()
    strict_devices.install_if_requested()
    rank, _, world = init_distributed(timeout_s=collective_timeout_s(cfg.resilience),
                                      ranks_per_gpu=cfg.cluster.ranks_per_gpu)
    if job.plan is not None and world != job.plan.dims.world:
        raise RuntimeError(f"the job was planned for {job.plan.dims.world} ranks and the launcher "
                           f"started {world}; plan and launch with the same cluster settings")
    init_parallel_state(cfg.parallelism, seed=cfg.trainer.seed)
    if job.run_dir is not None:
        write_pid_file(job.run_dir, rank)
    clock.mark("process_group")
    return Rank(job, rank, world, stop, console, heartbeat, startup, clock)


def _stop_contract(stop_signal: str, startup_exit: Optional[int],
                   on_stop: Callable[[int], None]) -> tuple:
    """This rank's :class:`StopRequest` and (with ``startup_exit``) :class:`StartupStop`: the
    ones installed at the command's first line when this process is that command (under
    ``srun``, or a job of one process), else new ones. Handed over, never reinstalled, so no
    instant of start-up is without a handler."""
    early = this_process_stop()
    if early is None:
        stop = StopRequest(stop_signal)
        startup = None if startup_exit is None else StartupStop(
            stop_signal, startup_exit, on_stop=on_stop, request=stop)
        return stop, startup
    stop, startup = early
    stop.watch_also(stop_signal)
    if startup_exit is None:  # this command's stops wait for a safe point from here on
        startup.finish()
        return stop, None
    startup.watch_also(stop_signal)
    startup.on_stop = on_stop
    return stop, startup


def _stopped_in_startup(console: Console, command: str, code: Optional[int],
                        heartbeat: Optional[Heartbeat], announce: bool) -> Callable[[int], None]:
    """What a rank stopped during start-up does before it exits: announce its code to the
    watch, one console line (rank 0, when ``announce``: no launcher above it speaks for the
    job), flush its streams."""
    import signal

    def say(signum: int) -> None:
        if heartbeat is not None:
            heartbeat.exiting(code, in_startup=True)
        if announce and launch_rank() == 0:
            console.error(f"{command}: stopped by {signal.Signals(signum).name} during start-up "
                          f"(nothing to save: the run resumes from its latest checkpoint); "
                          f"exiting {code}")
        console.settle()

    return say


def write_pid_file(run_dir: Path, rank: int) -> None:
    """``run_dir/logs/rank_<r>.pid``: this rank's process id, so that an operator (or a test) can
    signal one rank, e.g. the early-warning stop signal."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "logs" / f"rank_{rank}.pid", f"{os.getpid()}\n")
