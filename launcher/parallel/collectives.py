"""Every reduction the runtime makes, each on the device its process group needs.

NCCL reduces only tensors on the GPU; gloo reduces host tensors. :func:`device_for` is the one
place that decides which device a group's tensors live on, and every function here builds its
tensors there, so callers pass Python numbers (or tensors that are already on the group's device,
checked by :func:`sum_`). No other module of the runtime, the engines or the launch calls
``torch.distributed`` collectives directly (``tests/test_collectives.py`` enforces it).

Without an initialised default process group every function answers for a world of one.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from launcher.parallel.timing import median_seconds

Group = Any
"""A torch.distributed process group; None means the default (world) group."""


def initialized() -> bool:
    """Whether a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def device_for(group: Group = None) -> torch.device:
    """The device a collective on ``group`` needs its tensors on: this rank's GPU under NCCL,
    the host otherwise."""
    if initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(values: Sequence[float], op, group: Group, dtype=torch.float64) -> list[float]:
    """All-reduce ``values`` with ``op`` in one call; the results as Python floats."""
    if not initialized():
        return [float(v) for v in values]
    packed = torch.tensor([float(v) for v in values], dtype=dtype, device=device_for(group))
    dist.all_reduce(packed, op=op, group=group)
    return packed.tolist()


def sum_floats(values: Sequence[float], group: Group = None) -> list[float]:
    """Element-wise sum of ``values`` over the ranks of ``group``."""
    return _reduce(values, dist.ReduceOp.SUM, group)


def max_floats(values: Sequence[float], group: Group = None) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks of ``group``."""
    return _reduce(values, dist.ReduceOp.MAX, group)


def any_rank(flag: bool, group: Group = None) -> bool:
    """True on every rank of ``group`` when ``flag`` is True on any (stop agreement)."""
    return max_floats([1.0 if flag else 0.0], group)[0] > 0.0


def agree_loss(loss_sum: float, count: float, finite: bool,
               group: Group = None) -> tuple[float, float, bool]:
    """One all-reduce of (sum of losses, how many, any non-finite) over ``group``.

    Returns (total, total count, every rank finite). A rank with a non-finite loss contributes 0
    to the sum, so the total stays finite and every rank learns the same verdict. Ranks that
    computed no loss (non-last pipeline stages) pass 0 and count 0."""
    total, n, bad = sum_floats([loss_sum if finite else 0.0, count, 0.0 if finite else 1.0],
                               group)
    return total, n, bad == 0.0


def max_phase_times(times: dict, names: Sequence[str], group: Group = None) -> dict:
    """``times`` with each phase in ``names`` replaced by its maximum over ``group``."""
    present = [name for name in names if name in times]
    return {**times, **dict(zip(present, max_floats([times[n] for n in present], group)))}


def gather_floats(values: Sequence[float], group: Group = None) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), indexed by rank within ``group``."""
    if not initialized():
        return [[float(v) for v in values]]
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64,
                        device=device_for(group))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [part.cpu().tolist() for part in parts]


def sum_(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (it must already be on :func:`device_for`)."""
    if not initialized():
        return tensor
    expected = device_for(group)
    if tensor.device.type != expected.type:
        raise RuntimeError(f"collectives.sum_: tensor on {tensor.device}, but this group's "
                           f"backend ({dist.get_backend(group)}) needs {expected}")
    dist.all_reduce(tensor, group=group)
    return tensor


def max_(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over ``group``, in place (on :func:`device_for`)."""
    if not initialized():
        return tensor
    expected = device_for(group)
    if tensor.device.type != expected.type:
        raise RuntimeError(f"collectives.max_: tensor on {tensor.device}, but this group's "
                           f"backend ({dist.get_backend(group)}) needs {expected}")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def broadcast_int(value: int, src: int, group: Group = None) -> int:
    """``value`` of global rank ``src`` on every rank of ``group`` (``value`` itself without a
    process group)."""
    return broadcast_ints([value], src, group)[0]


def broadcast_ints(values: Sequence[int], src: int, group: Group = None) -> list[int]:
    """``values`` (the same length on every rank) of global rank ``src`` on every rank of
    ``group`` (themselves without a process group)."""
    if not initialized():
        return [int(v) for v in values]
    packed = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device_for(group))
    dist.broadcast(packed, src=src, group=group)
    return [int(v) for v in packed.tolist()]


def gather_objects(value: Any, group: Group = None) -> list:
    """Every rank's picklable ``value``, in rank order (``[value]`` without a process group).
    For small records (file lists, results), never tensors."""
    if not initialized():
        return [value]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def barrier(group: Group = None) -> None:
    """Wait for every rank of ``group`` (nothing without a process group)."""
    if initialized():
        dist.barrier(group=group)


def rank(group: Group = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if initialized() else 0


def world_size(group: Group = None) -> int:
    """Ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if initialized() else 1


def group_sizes(world: int) -> list[int]:
    """The group sizes the probe measures on ``world`` ranks: 2, 4, 8, ... up to ``world``,
    and ``world`` itself (the sizes a layout's TP, DP and PP groups on one node take)."""
    sizes, size = [], 2
    while size < world:
        if world % size == 0:
            sizes.append(size)
        size *= 2
    return sizes + [world] if world > 1 else []


def subgroup_of_size(size: int) -> Group:
    """This rank's group of ``size`` consecutive ranks (the world split into groups of that
    size, all made at once: every rank must call it with the same ``size``); None (the world)
    when ``size`` is the world's."""
    if size == world_size():
        return None
    group, _ = dist.new_subgroups(group_size=size)
    return group


COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")
"""What :func:`collective_seconds` times: every collective a layout issues."""


def collective_seconds(op: str, numel: int, dtype: torch.dtype = torch.float32,
                       reps: int = 5, group: Group = None) -> float:
    """Median seconds of one ``op`` (:data:`COLLECTIVE_OPS`) of a ``numel``-element tensor per
    rank over ``group`` (the machine probe's figure; ``send_recv``: each rank sends to the next
    and receives from the previous, as pipeline stages do), each timed to its completion on the
    device (NCCL returns when the collective is enqueued), the slowest rank's."""
    n, device = world_size(group), device_for(group)
    numel = max(n, numel - numel % n)
    data = torch.ones(numel, dtype=dtype, device=device)
    out = torch.empty(numel // n if op == "reduce_scatter" else numel * n if op == "all_gather"
                      else numel, dtype=dtype, device=device)

    def once() -> None:
        if op == "all_reduce":
            dist.all_reduce(data, group=group)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(out, data, group=group)
        elif op == "all_gather":
            dist.all_gather_into_tensor(out, data, group=group)
        elif op == "all_to_all":
            dist.all_to_all_single(out, data, group=group)
        elif op == "send_recv":
            me = rank(group)
            ops = [dist.P2POp(dist.isend, data, dist.get_global_rank(group or dist.group.WORLD,
                                                                     (me + 1) % n), group),
                   dist.P2POp(dist.irecv, out, dist.get_global_rank(group or dist.group.WORLD,
                                                                    (me - 1) % n), group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        else:
            raise ValueError(f"unknown collective {op!r}; one of {', '.join(COLLECTIVE_OPS)}")

    seconds = median_seconds(once, reps=reps, warmup=1, device=device,
                             before=lambda: barrier(group))
    return max_floats([seconds], group)[0]
