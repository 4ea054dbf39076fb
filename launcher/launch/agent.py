"""``python -m launcher.launch.agent``: one torchrun-style elastic agent per node (``launch.mode=torchrun``).

    python -m launcher.launch.agent --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=node001:29500 \\
        --rdzv-id=$SLURM_JOB_ID -- [launcher.train overrides]

Every agent joins a c10d rendezvous at ``--rdzv-endpoint`` (the job's first node hosts it), the
agents agree on ranks, and each starts ``--nproc-per-node`` processes of
``python -m launcher.train <overrides>`` with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, exactly as ``torchrun --nnodes ... -m launcher.train`` would. Two differences
from torchrun, both for requeueing: a stop signal (SIGTERM, SIGINT, SIGUSR2 or the early-warning
signal) sent to the agent is forwarded to its training processes, which save and exit 75, instead
of killing them; and the agent exits with the failing worker's own exit code (torchrun exits 1),
so 75 reaches the job script.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from launcher.core.stop import child_ranks, elastic_signals, forward_stop_signals
from launcher.launch.local import failure_exit_code


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launcher.launch.agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnodes", type=int, required=True, help="agents (nodes) in the world")
    parser.add_argument("--nproc-per-node", type=int, required=True,
                        help="training processes this agent starts")
    parser.add_argument("--rdzv-endpoint", required=True, help="host:port of the rendezvous")
    parser.add_argument("--rdzv-id", required=True, help="same on every agent (the job id)")
    parser.add_argument("--local-addr", default=None,
                        help="address the other agents reach this one at (default: hostname)")
    parser.add_argument("--stop-signal", default="SIGUSR1",
                        help="the workers' trainer.stop_signal (forwarded to them, as SIGTERM/SIGINT/SIGUSR2)")
    parser.add_argument("overrides", nargs="*", help="launcher.train overrides (after --)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    config = LaunchConfig(
        min_nodes=args.nnodes, max_nodes=args.nnodes, nproc_per_node=args.nproc_per_node,
        run_id=args.rdzv_id, role="trainer", rdzv_backend="c10d",
        rdzv_endpoint=args.rdzv_endpoint, max_restarts=0, monitor_interval=0.1,
        start_method="spawn", local_addr=args.local_addr, logs_specs=DefaultLogsSpecs(),
        signals_to_handle=elastic_signals(args.stop_signal))
    forward_stop_signals(args.stop_signal, child_ranks)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "launcher.train", *args.overrides)
    except ChildFailedError as exc:
        _, code, message = failure_exit_code(exc)
        print(f"launcher.launch.agent: {message}; exiting with {code}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
