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
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from launcher.launch.local import Rendezvous


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launcher.launch.agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnodes", type=int, required=True, help="agents (nodes) in the world")
    parser.add_argument("--nproc-per-node", type=int, required=True,
                        help="training processes this agent starts (the config's "
                             "cluster.gpus_per_node x cluster.ranks_per_gpu)")
    parser.add_argument("--rdzv-endpoint", required=True, help="host:port of the rendezvous")
    parser.add_argument("--rdzv-id", required=True, help="same on every agent (the job id)")
    parser.add_argument("--local-addr", default=None,
                        help="address the other agents reach this one at (default: hostname)")
    parser.add_argument("overrides", nargs="*", help="launcher.train overrides (after --)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    rendezvous = Rendezvous(args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.local_addr,
                            args.nproc_per_node)
    os.environ.update(rendezvous.to_env())
    command = [sys.executable, "-u", "-m", "launcher.train", *args.overrides]
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
