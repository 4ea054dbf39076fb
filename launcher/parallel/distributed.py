"""Process-group setup: torchrun / Slurm environments, a local multi-process launcher, init.

Three ways a training process can start, all ending in :func:`init_distributed`:

* under ``torchrun`` (or any launcher that sets RANK and WORLD_SIZE): used as is;
* under ``srun`` with one task per GPU: :func:`torch_env_from_slurm` derives RANK, LOCAL_RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from Slurm's variables;
* from a plain ``python -m launcher.train`` on one machine:
  :func:`launcher.launch.local.launch_world` spawns the workers with torch's elastic
  launcher (c10d rendezvous on localhost, a free port).

torch is imported lazily so that the pure helpers (hostlist expansion, env mapping) stay cheap.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import sys
from typing import Mapping

DEFAULT_TIMEOUT_S = 1800.0
"""Default collective timeout (seconds) of the default process group."""

_BRACKET_RE = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced or nested brackets in hostlist {text!r}")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in hostlist {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(spec: str, hostlist: str) -> list[str]:
    """``01-03,07`` -> ``01 02 03 07`` (zero padding kept from the lower bound)."""
    out = []
    for item in spec.split(","):
        low, sep, high = item.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {item!r} in hostlist {hostlist!r}")
        if not sep:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"descending range {item!r} in hostlist {hostlist!r}")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


def _expand_one(pattern: str, hostlist: str) -> list[str]:
    """Expand every bracket group of one host pattern (cartesian product, left to right)."""
    match = _BRACKET_RE.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [head + value + rest for value in _expand_ranges(match.group(1), hostlist)
            for rest in _expand_one(tail, hostlist)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm hostlist syntax to host names, in order.

    ``node[01-03,07],gpu5`` -> ``node01 node02 node03 node07 gpu5``;
    ``rack[1-2]-n[1-2]`` -> ``rack1-n1 rack1-n2 rack2-n1 rack2-n2``. Raises ValueError on
    malformed input.
    """
    hosts = [host for part in _split_top_level(hostlist) for host in _expand_one(part, hostlist)]
    if not hosts:
        raise ValueError(f"empty hostlist {hostlist!r}")
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM_TASKS_PER_NODE (``2(x3),1``) -> the task count of node ``node_id``."""
    counts = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ValueError(f"bad SLURM_TASKS_PER_NODE {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node_id, len(counts) - 1)]


def in_distributed_launch(env: Mapping[str, str] = os.environ) -> bool:
    """True under torchrun-style launchers (RANK and WORLD_SIZE set) or a multi-task ``srun``."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return True
    under_srun = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    return under_srun and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


def launch_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's global rank from its launcher's variables (RANK, else an ``srun`` task's
    SLURM_PROCID), before any process group exists; 0 for a single process."""
    if "RANK" in env:
        return int(env["RANK"])
    return int(env["SLURM_PROCID"]) if in_distributed_launch(env) else 0


def torch_env_from_slurm(env: Mapping[str, str]) -> dict:
    """torch.distributed's env:// variables derived from an ``srun`` task's Slurm variables.

    SLURM_PROCID -> RANK, SLURM_LOCALID -> LOCAL_RANK, SLURM_NTASKS -> WORLD_SIZE,
    SLURM_NTASKS_PER_NODE (else this node's entry of SLURM_TASKS_PER_NODE) -> LOCAL_WORLD_SIZE,
    first host of SLURM_JOB_NODELIST -> MASTER_ADDR, 20000 + SLURM_JOB_ID % 20000 -> MASTER_PORT.
    MASTER_ADDR and MASTER_PORT already in ``env`` are kept. Returns only the derived variables.
    """
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS") if k not in env]
    if missing:
        raise ValueError(f"not a Slurm task: {', '.join(missing)} not set")
    out = {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
           "WORLD_SIZE": env["SLURM_NTASKS"]}
    if env.get("SLURM_NTASKS_PER_NODE"):
        out["LOCAL_WORLD_SIZE"] = str(_tasks_on_node(env["SLURM_NTASKS_PER_NODE"], 0))
    elif env.get("SLURM_TASKS_PER_NODE"):
        node_id = int(env.get("SLURM_NODEID", "0"))
        out["LOCAL_WORLD_SIZE"] = str(_tasks_on_node(env["SLURM_TASKS_PER_NODE"], node_id))
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    out["MASTER_ADDR"] = env.get("MASTER_ADDR") or (
        expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
    if env.get("MASTER_PORT"):
        out["MASTER_PORT"] = env["MASTER_PORT"]
    elif env.get("SLURM_JOB_ID"):
        out["MASTER_PORT"] = str(20000 + int(env["SLURM_JOB_ID"]) % 20000)
    else:
        raise ValueError("neither MASTER_PORT nor SLURM_JOB_ID is set; cannot pick a port")
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _single_process_env() -> None:
    """Make a plain ``python`` process a world of one; check a launched one has a rendezvous."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return
    os.environ.setdefault("LOCAL_RANK", "0")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"launched process lacks {', '.join(missing)}; start it with torchrun, "
                           f"srun or launcher.launch.local.launch_world")


LAUNCHED_LOCAL_RANK_ENV = "TRAINWRIGHT_LOCAL_RANK"
"""The local rank the launcher gave, kept where ranks share a GPU (:func:`shared_gpu_env`)."""


def shared_gpu_env(rank: int, local_rank: int, ranks_per_gpu: int, host: str) -> dict:
    """What a rank that shares its GPU with others sets: its own ``NCCL_HOSTID`` (NCCL refuses
    two ranks of one host on one device, but ranks it believes are on different hosts share
    it), and ``LOCAL_RANK`` naming that GPU, since libraries take it for a device index
    (DeepSpeed's ZeRO-3 ``Init`` and its rank checks: ``cuda:<LOCAL_RANK>``, an invalid ordinal
    at local rank 1 of 2 on one GPU); the launcher's own value stays in
    :data:`LAUNCHED_LOCAL_RANK_ENV`."""
    return {"NCCL_HOSTID": f"{host}-rank{rank}", LAUNCHED_LOCAL_RANK_ENV: str(local_rank),
            "LOCAL_RANK": str(local_rank // ranks_per_gpu)}


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S,
                     ranks_per_gpu: int = 1) -> tuple[int, int, int]:
    """Initialise the default process group; return (rank, local_rank, world_size).

    Slurm variables are translated when RANK is not set; a process started without any launcher
    becomes a world of one. Backend nccl when CUDA is available (the CUDA device is set from the
    local rank first), else gloo. ``timeout_s`` bounds every collective. Idempotent.

    With ``ranks_per_gpu`` > 1 (development: cluster.ranks_per_gpu) consecutive local ranks share
    one GPU (:func:`shared_gpu_env`: their own ``NCCL_HOSTID``, ``LOCAL_RANK`` naming the GPU).
    """
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ and in_distributed_launch(os.environ):
        os.environ.update(torch_env_from_slurm(os.environ))
    _single_process_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get(LAUNCHED_LOCAL_RANK_ENV, os.environ["LOCAL_RANK"]))
    if dist.is_initialized():
        return dist.get_rank(), local_rank, dist.get_world_size()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank // ranks_per_gpu)
        if ranks_per_gpu > 1:
            os.environ.update(shared_gpu_env(rank, local_rank, ranks_per_gpu,
                                             socket.gethostname()))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timeout)
    return rank, local_rank, world


def attempt_store(timeout):
    """Under torch elastic's agent: its store, with this attempt's own key prefix.

    The agent keeps one store for every restart of the worker group (torch 2.13,
    pytorch/pytorch#167288), so with ``env://`` a restarted rank can read the previous
    attempt's keys, e.g. a dead rank's gloo address ("Connection refused" in
    connectFullMesh). Prefixing the keys with TORCHELASTIC_RESTART_COUNT keeps attempts apart.
    None outside torch elastic (srun, a single process): ``env://`` as usual."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"trainwright/attempt_{restart}", client)


def destroy_distributed() -> None:
    """Destroy Megatron's model-parallel groups (if Megatron is loaded) and the default group."""
    import torch.distributed as dist

    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
