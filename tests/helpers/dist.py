"""Helpers for tests that need torch.distributed: an in-process 1-rank gloo group, and
:func:`run_distributed`, which runs a function in N fresh processes and returns their results.

Groups rendezvous through a FileStore in a private temporary directory, so concurrent tests
(``pytest -n 2``) never compete for a TCP port. Multi-process workers are plain subprocesses of
this file (``python tests/helpers/dist.py``), whose ``__main__`` guard keeps dist-checkpointing's
spawn Manager from re-running them. A target is ``"package.module:function"`` or
``"path/to/file.py:function"``; it takes the ``args`` dict and returns something JSON-serialisable.
Workers see RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as under
torchrun, and run with one compute thread each.

    results = run_distributed("tests.test_model_build:tp_worker", 2, {"seed": 1})

Formerly tests/_dist.py.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port that was free a moment ago (for code that insists on MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_gloo(store_path: str, rank: int, world_size: int, backend: str = "gloo") -> None:
    """Join a group (gloo, or nccl on GPU rank % count) that rendezvouses through the file at
    ``store_path``."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def _teardown() -> None:
    """Destroy Megatron's parallel state (when imported) and the default process group."""
    import torch.distributed as dist

    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def gloo_group() -> Iterator[None]:
    """A 1-process gloo default group for the duration of the block (use in a fixture)."""
    from launcher.engines import compat

    compat.install()
    with tempfile.TemporaryDirectory(prefix="tw_gloo_") as tmp:
        _init_gloo(os.path.join(tmp, "store"), 0, 1)
        try:
            yield
        finally:
            _teardown()


def _load_target(target: str) -> Callable[[dict], Any]:
    """Resolve ``"module:function"`` or ``"file.py:function"``."""
    module_name, _, func_name = target.rpartition(":")
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_tw_dist_target", module_name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, func_name)


def _worker_env(rank: int, nprocs: int, port: int, backend: str) -> dict:
    """Environment of one worker: torchrun's variables, one thread, repo on the path.

    With ``backend="nccl"`` and fewer GPUs than ranks, each rank gets its own ``NCCL_HOSTID``:
    NCCL refuses two ranks on one GPU of one host, but ranks it believes are on different hosts
    share the GPU and talk over loopback sockets (slow, but correct: for GPU tests on one card).
    """
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1", TW_TEST_BACKEND=backend,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    if backend == "nccl" and _gpu_count() < nprocs:
        env.update(NCCL_HOSTID=f"tw-test-rank{rank}", NCCL_SOCKET_IFNAME="lo")
    return env


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _wait_all(procs: List[subprocess.Popen], timeout: float) -> None:
    """Wait for every worker; if one fails or time runs out, kill the rest."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()


def run_distributed(
    target: str, nprocs: int, args: Optional[dict] = None, timeout: float = 240.0,
    backend: str = "gloo",
) -> List[Any]:
    """Run ``target(args)`` on ``nprocs`` ranks in fresh processes; return results by rank.

    ``backend`` is ``"gloo"`` (CPU) or ``"nccl"`` (rank r on GPU r modulo the GPU count).

    Raises RuntimeError with the tail of each failed rank's log when any rank fails or times out.
    """
    with tempfile.TemporaryDirectory(prefix="tw_dist_") as tmp:
        port = free_port()
        cmd = [sys.executable, str(Path(__file__).resolve()), target, tmp]
        Path(tmp, "args.json").write_text(json.dumps(args or {}))
        procs = []
        for rank in range(nprocs):
            log = open(Path(tmp, f"rank{rank}.log"), "w")
            procs.append(subprocess.Popen(cmd, env=_worker_env(rank, nprocs, port, backend),
                                          cwd=REPO_ROOT,
                                          stdout=log, stderr=subprocess.STDOUT))
            log.close()
        _wait_all(procs, timeout)
        errors = [f"--- rank {r} (rc {p.returncode}) ---\n"
                  + Path(tmp, f"rank{r}.log").read_text()[-4000:]
                  for r, p in enumerate(procs) if p.returncode != 0]
        if errors:
            raise RuntimeError(f"{target} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nprocs)]


def _worker_main(target: str, tmp: str) -> None:
    """Body of one worker process: join the group, run the target, write rank<r>.json."""
    import torch

    from launcher.engines import compat

    torch.set_num_threads(1)
    compat.install()  # library shims at worker start, as launcher.train's workers do
    from launcher.runtime.strict_devices import install_if_requested

    install_if_requested()  # TRAINWRIGHT_STRICT_DEVICES=1: host tensors on NCCL groups fail
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init_gloo(os.path.join(tmp, "store"), rank, world, os.environ.get("TW_TEST_BACKEND", "gloo"))
    try:
        result = _load_target(target)(json.loads(Path(tmp, "args.json").read_text()))
        Path(tmp, f"rank{rank}.json.part").write_text(json.dumps(result))
        os.replace(Path(tmp, f"rank{rank}.json.part"), Path(tmp, f"rank{rank}.json"))
    finally:
        _teardown()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    _worker_main(sys.argv[1], sys.argv[2])
