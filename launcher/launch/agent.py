"""``python -m launcher.launch.agent``: one elastic agent per node (``launch.mode=torchrun``).

    python -m launcher.launch.agent --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=node001:29500 \\
        --rdzv-id=$SLURM_JOB_ID -- [launcher.train overrides]

The job script starts one agent per node. The agent becomes ``python -m launcher.train
<overrides>`` (the same process: ``exec``) with the rendezvous in its environment
(:class:`launcher.launch.local.Rendezvous`): that process composes and plans the job once for its
node, and the bootstrap (:func:`launcher.launch.bootstrap.run_ranks`) starts the node's ranks,
which join the other nodes' at ``--rdzv-endpoint`` (c10d; the job's first node hosts it), with
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set exactly as under ``torchrun``.
Two differences from torchrun, both for requeueing: a stop signal (SIGTERM, SIGINT, SIGUSR2 or
the early-warning signal) sent to the agent is forwarded to its training processes, which save
and exit 75, instead of killing them; and the agent exits with the failing rank's own exit code
(torchrun exits 1), so 75 reaches the job script.

In a Kubernetes pod the counts and the endpoint come, as torchrun's do, from the PET_* variables
that Kubeflow's Trainer (or the rendered JobSet) sets: ``--nnodes`` from PET_NNODES,
``--nproc-per-node`` from PET_NPROC_PER_NODE, ``--rdzv-endpoint`` from PET_MASTER_ADDR and
PET_MASTER_PORT.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a stop signal from here waits, held, for launcher.train's
    from launcher.core.stop import hold_stop_signals  # handler (exec keeps it pending)

    hold_stop_signals()

import argparse
import os
import sys
from typing import Callable, Sequence

from launcher.core.exits import REQUEUE_EXIT
from launcher.launch.local import Rendezvous


PET_DEFAULTS = {"nnodes": "PET_NNODES", "nproc_per_node": "PET_NPROC_PER_NODE"}
"""Flags that, as under torchrun, default to the variables Kubeflow's Trainer and the
training-operator inject into each pod (``--rdzv-endpoint`` from PET_MASTER_ADDR and
PET_MASTER_PORT)."""


def pet_endpoint(env) -> str | None:
    """``PET_MASTER_ADDR:PET_MASTER_PORT`` when both are set."""
    if env.get("PET_MASTER_ADDR") and env.get("PET_MASTER_PORT"):
        return f"{env['PET_MASTER_ADDR']}:{env['PET_MASTER_PORT']}"
    return None


def parse_args(argv: Sequence[str], env=os.environ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launcher.launch.agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnodes", type=int, default=env.get(PET_DEFAULTS["nnodes"]),
                        help="agents (nodes) in the world (default: $PET_NNODES)")
    parser.add_argument("--nproc-per-node", type=int,
                        default=env.get(PET_DEFAULTS["nproc_per_node"]),
                        help="training processes this agent starts (the config's "
                             "cluster.gpus_per_node x cluster.ranks_per_gpu; default: "
                             "$PET_NPROC_PER_NODE)")
    parser.add_argument("--rdzv-endpoint", default=pet_endpoint(env),
                        help="host:port of the rendezvous (default: "
                             "$PET_MASTER_ADDR:$PET_MASTER_PORT)")
    parser.add_argument("--rdzv-id", required=True, help="same on every agent (the job id)")
    parser.add_argument("--local-addr", default=None,
                        help="address the other agents reach this one at (default: hostname)")
    parser.add_argument("--requeue-exit", type=int, default=None, choices=range(1, 256),
                        metavar="CODE", help=f"exit with CODE instead of {REQUEUE_EXIT} after a "
                        "stop for requeue (for schedulers that retry only some codes)")
    parser.add_argument("overrides", nargs="*", help="launcher.train overrides (after --)")
    args = parser.parse_args(argv)
    for flag in ("nnodes", "nproc_per_node", "rdzv_endpoint"):
        if getattr(args, flag) in (None, ""):
            parser.error(f"--{flag.replace('_', '-')} is required (or set "
                         f"{PET_DEFAULTS.get(flag, 'PET_MASTER_ADDR and PET_MASTER_PORT')})")
    return args


REQUEUE_EXIT_ENV = "TRAINWRIGHT_REQUEUE_EXIT"
"""Set by ``--requeue-exit``: the code a stop for requeue (75) leaves the process with."""


def scheduler_exit(main: Callable[[], int]) -> int:
    """``main()``'s exit code, with 75 replaced by $TRAINWRIGHT_REQUEUE_EXIT when set (a
    scheduler that reads "retry" in other codes: PyTorchJob's ExitCode policy)."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    exit_without_collecting()
    replacement = os.environ.get(REQUEUE_EXIT_ENV)
    return int(replacement) if code == REQUEUE_EXIT and replacement else code


def exit_without_collecting() -> None:
    """The process is about to exit: move every live object out of the garbage collector's
    reach, so that the interpreter's final collections skip them. With torch and Megatron-Core
    loaded, finalization took 0.75 s (0.15 s frozen), paid by every rank and the launcher after
    the final save."""
    import gc

    gc.freeze()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.requeue_exit is not None:
        os.environ[REQUEUE_EXIT_ENV] = str(args.requeue_exit)
    rendezvous = Rendezvous(args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.local_addr,
                            args.nproc_per_node)
    os.environ.update(rendezvous.to_env())
    command = [sys.executable, "-u", "-m", "launcher.train", *args.overrides]
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
