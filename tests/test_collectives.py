"""launcher.parallel.collectives: the one module that calls torch.distributed collectives.

Checks: no other module of the project calls a collective directly (an AST scan, so a new call
site fails here); each reduction gives the right numbers on 2 gloo ranks, including ranks that
contribute nothing (the non-last pipeline stages of the loss agreement); ``sum_`` refuses a
tensor on another device than its group needs; without a process group every function answers
for a world of one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
               "_all_gather_base", "_reduce_scatter_base"}
OWNER = ROOT / "launcher" / "parallel" / "collectives.py"


def _dist_aliases(tree: ast.Module) -> set:
    """Names bound to torch.distributed in a module (``dist``, ``torch.distributed``)."""
    names = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(
                a.name == "distributed" for a in node.names):
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


def direct_collective_calls(path: Path) -> list:
    """``file:line name`` of every torch.distributed collective called in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, found = _dist_aliases(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in COLLECTIVES and ast.unparse(node.func.value) in aliases:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}"
                      for a in node.names if a.name in COLLECTIVES]
    return found


def test_only_the_collectives_module_calls_collectives():
    files = [p for folder in ("launcher", "data_prep") for p in (ROOT / folder).rglob("*.py")
             if p != OWNER]
    offenders = [hit for path in files for hit in direct_collective_calls(path)]
    assert offenders == [], ("call launcher.parallel.collectives instead of torch.distributed "
                             f"in: {offenders}")


def test_the_scan_finds_a_direct_call():
    """The scan itself: the bug shape of the PP=2 crash is found in any spelling."""
    sample = ROOT / "tests" / "_collective_sample.py"
    sample.write_text("import torch\nimport torch.distributed as dist\n"
                      "from torch.distributed import barrier\n"
                      "def f(x):\n    torch.distributed.all_reduce(x)\n    dist.broadcast(x, 0)\n")
    try:
        hits = direct_collective_calls(sample)
    finally:
        sample.unlink()
    assert sorted(hits) == ["tests/_collective_sample.py:3 import barrier",
                            "tests/_collective_sample.py:5 all_reduce",
                            "tests/_collective_sample.py:6 broadcast"]


def reductions_worker(args: dict) -> dict:
    """Each reduction on 2 ranks; rank 0 plays a stage without a loss."""
    import torch

    from launcher.parallel import collectives

    rank = collectives.rank()
    out = {"device": str(collectives.device_for()), "world": collectives.world_size()}
    loss, count = (0.0, 0) if rank == 0 else (6.0, 3)
    out["agree"] = collectives.agree_loss(loss, count, True)
    out["agree_nan"] = collectives.agree_loss(float("nan") if rank == 1 else 1.0, 1,
                                              rank != 1)
    out["any"] = [collectives.any_rank(rank == 1), collectives.any_rank(False)]
    out["max"] = collectives.max_phase_times({"forward": 1.0 + rank, "loss": 2.0 * rank,
                                              "other": 7.0 + rank}, ["forward", "loss"])
    out["gather"] = collectives.gather_floats([rank, 10.0 * rank])
    out["sum_"] = collectives.sum_(torch.full((2,), rank + 1.0, device="cpu")).tolist()
    out["broadcast"] = collectives.broadcast_int(40 + rank, src=1)
    collectives.barrier()
    return out


@pytest.mark.slow
def test_reductions_on_two_ranks():
    from tests.helpers.dist import run_distributed

    r0, r1 = run_distributed("tests.test_collectives:reductions_worker", 2, {})
    for r in (r0, r1):
        assert r["device"] == "cpu" and r["world"] == 2
        assert r["agree"] == [6.0, 3.0, True]  # rank 0 contributed no loss and no count
        assert r["agree_nan"] == [1.0, 2.0, False]  # the non-finite rank contributes 0
        assert r["any"] == [True, False]
        assert r["max"] == {"forward": 2.0, "loss": 2.0, "other": 7.0 + (r is r1)}
        assert r["gather"] == [[0.0, 0.0], [1.0, 10.0]]
        assert r["sum_"] == [3.0, 3.0]
        assert r["broadcast"] == 41  # rank 1's value everywhere


def test_world_of_one_without_a_process_group():
    import torch.distributed as dist

    from launcher.parallel import collectives

    assert not dist.is_initialized()
    assert collectives.agree_loss(2.0, 1, True) == (2.0, 1.0, True)
    assert collectives.any_rank(True) and not collectives.any_rank(False)
    assert collectives.gather_floats([1.5]) == [[1.5]]
    assert collectives.broadcast_int(7, src=0) == 7
    assert (collectives.rank(), collectives.world_size()) == (0, 1)


def test_sum_refuses_a_tensor_on_the_wrong_device(monkeypatch):
    import torch

    from launcher.parallel import collectives

    monkeypatch.setattr(collectives, "initialized", lambda: True)
    monkeypatch.setattr(collectives, "device_for", lambda group=None: torch.device("cuda", 0))
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="tensor on cpu, but this group's backend \\(nccl\\) "
                                           "needs cuda:0"):
        collectives.sum_(torch.zeros(2))
