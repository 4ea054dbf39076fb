"""Strict device mode (launcher.runtime.strict_devices): host tensors handed to collectives on
groups that are NCCL on GPU machines fail on CPU too."""

from __future__ import annotations

import sys

import pytest
import torch

from launcher.runtime import strict_devices as sd
from tests.helpers.dist import run_distributed

HERE = "tests/test_strict_devices.py"


def _line() -> int:
    """The caller's line number (to check the ``file:line`` an error names)."""
    return sys._getframe(1).f_lineno


# ---------------------------------------------------------------- tagging rules, in process


def test_factories_without_device_are_host_with_device_not():
    with sd.HostTrackingMode():
        host, line = torch.zeros(()), _line()
        on_device = [torch.zeros(2, device="cpu"), torch.ones(2, device=torch.device("cpu")),
                     torch.tensor([1.0], device="cpu"), torch.arange(3, device="cpu"),
                     torch.full((2,), 1.0, device="cpu"), torch.as_tensor([1.0], device="cpu")]
        others = [torch.tensor(1.0), torch.arange(3), torch.empty(2), torch.randn(2),
                  torch.eye(2), torch.scalar_tensor(1.0), torch.linspace(0, 1, 3)]
    assert sd.host_origin(host) == f"{HERE}:{line}"
    assert [sd.host_origin(t) for t in on_device] == [None] * len(on_device)
    assert all(sd.host_origin(t) is not None for t in others)


def test_derived_tensors_follow_their_inputs():
    with sd.HostTrackingMode():
        host, device = torch.zeros(3), torch.ones(3, device="cpu")
        stacked = torch.stack([torch.zeros(()), torch.tensor(1.0)])
        assert sd.host_origin(stacked) is not None
        assert sd.host_origin(host * 2 + 1) is not None
        assert sd.host_origin(host[0]) is not None
        assert sd.host_origin(torch.zeros_like(host)) is not None
        assert sd.host_origin(host.new_zeros(2)) is not None
        assert sd.host_origin(host.to(torch.float64)) is not None
        # mixing a host tensor with a device tensor gives a device tensor, as on CUDA
        assert sd.host_origin(torch.tensor(2.0) * device) is None
        assert sd.host_origin(torch.stack([host, device])) is None
        assert sd.host_origin(torch.zeros_like(host, device="cpu")) is None
        assert sd.host_origin(torch.zeros_like(device)) is None
        assert sd.host_origin(device.sum()) is None


def test_moves_and_in_place_ops():
    with sd.HostTrackingMode():
        host, device = torch.zeros(3), torch.ones(3, device="cpu")
        moved = host.clone().to("cpu")
        assert sd.host_origin(moved) is None
        assert sd.host_origin(host.clone().to(device)) is None
        to_host = device.to(torch.zeros(1))
        assert to_host is not device and sd.host_origin(to_host) is not None
        assert sd.host_origin(device.to(host.device)) is not None
        assert sd.host_origin(torch.tensor(1.0, device=host.device)) is not None
        assert sd.host_origin(torch.zeros_like(device, device=host.device)) is not None
        assert sd.host_origin(torch.tensor(1.0, device=device.device)) is None
        copied = device.cpu()
        assert copied is not device and sd.host_origin(copied) is not None
        assert sd.host_origin(device) is None  # .cpu() does not mark its input
        assert sd.host_origin(device.add_(host)) is None  # in place: stays on its device
        buffer = torch.zeros(3)
        buffer.copy_(device)
        assert sd.host_origin(buffer) is not None  # a host buffer stays on the host
        buffer.data = torch.ones(3, device="cpu")
        assert sd.host_origin(buffer) is None


def test_untagged_tensors_are_not_host():
    outside = torch.zeros(2)  # created outside the mode (e.g. a DataLoader worker)
    with sd.HostTrackingMode():
        assert sd.host_origin(outside) is None
        assert sd.host_origin(outside + torch.zeros(2)) is None


def test_install_does_nothing_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sd.install() is False
    assert not sd.is_installed()


def test_enabled_by_env(monkeypatch):
    monkeypatch.delenv(sd.ENV_VAR, raising=False)
    assert not sd.enabled_by_env() and sd.install_if_requested() is False
    monkeypatch.setenv(sd.ENV_VAR, "0")
    assert not sd.enabled_by_env()
    monkeypatch.setenv(sd.ENV_VAR, "1")
    assert sd.enabled_by_env()


# ---------------------------------------------------------------- collectives, 2 ranks


def _outcome(fn):
    """"ok: <result>" or "error: <DeviceRuleError message>" (every rank takes the same path)."""
    try:
        return f"ok: {fn()}"
    except sd.DeviceRuleError as exc:
        return f"error: {exc}"


def _reduced(tensor, group=None):
    torch.distributed.all_reduce(tensor, group=group)
    return tensor.tolist()


def _p2p(tensor, peer):
    op = torch.distributed.isend if torch.distributed.get_rank() == 0 else torch.distributed.irecv
    for work in torch.distributed.batch_isend_irecv([torch.distributed.P2POp(op, tensor, peer)]):
        work.wait()
    return tensor.tolist()


def _p2p_cases(rank: int) -> dict:
    peer = 1 - rank
    return {
        "p2p_host": _outcome(lambda: _p2p(torch.zeros(2), peer)),
        "p2p_device": _outcome(lambda: _p2p(torch.full((2,), float(rank), device="cpu"), peer)),
    }


def _group_cases() -> dict:
    gloo = torch.distributed.new_group([0, 1], backend="gloo")
    nccl = torch.distributed.new_group([0, 1])
    return {
        "gloo_group_host": _outcome(lambda: _reduced(torch.ones(2), gloo)),
        "plain_group_host": _outcome(lambda: _reduced(torch.ones(2), nccl)),
        "real_backends": [sd.real_backend(gloo), sd.real_backend(nccl), sd.real_backend(None)],
    }


def rules_worker(args: dict) -> dict:
    from torch.overrides import _get_current_function_mode_stack

    assert sd.install() and sd.install() and sd.is_installed()
    rank = torch.distributed.get_rank()
    host, line = torch.zeros(()), _line()
    device = torch.ones(3, device="cpu")
    results = {
        "line": line,
        "host_zeros": _outcome(lambda: _reduced(host)),
        "explicit_cpu": _outcome(lambda: _reduced(torch.zeros((), device="cpu") + rank + 1)),
        "stacked": _outcome(lambda: _reduced(torch.stack([torch.zeros(()), torch.tensor(1.0)]))),
        "mixed": _outcome(lambda: _reduced(torch.tensor(2.0) * device)),
        "cpu_result": _outcome(lambda: _reduced(device.clone().cpu())),
        "moved": _outcome(lambda: _reduced(torch.zeros(2).to(device.device) + 1)),
        "cuda_device": _outcome(lambda: _reduced(torch.ones((), device="cuda"))),
        "cuda_moved": _outcome(lambda: _reduced(torch.ones(()).cuda())),
        "all_gather_host": _outcome(lambda: torch.distributed.all_gather(
            [torch.zeros(1, device="cpu") for _ in range(2)], torch.zeros(1))),
        "top_mode": type(_get_current_function_mode_stack()[-1]).__name__,
        "modes": [type(m).__name__ for m in _get_current_function_mode_stack()],
    }
    return {**results, **_group_cases(), **_p2p_cases(rank)}


@pytest.fixture(scope="module")
def rules():
    return run_distributed("tests.test_strict_devices:rules_worker", 2)


@pytest.mark.xdist_group("strict_device_rules")  # its module fixture, built once
@pytest.mark.slow
def test_host_tensor_on_default_group_fails_naming_its_origin(rules):
    for result in rules:
        assert result["host_zeros"].startswith("error: torch.distributed.all_reduce on a group "
                                               "whose backend on a GPU machine is NCCL")
        assert f"created at {HERE}:{result['line']};" in result["host_zeros"]


@pytest.mark.xdist_group("strict_device_rules")  # its module fixture, built once
@pytest.mark.slow
def test_device_tensors_reduce(rules):
    for result in rules:
        assert result["explicit_cpu"] == "ok: 3.0"
        assert result["mixed"] == "ok: [4.0, 4.0, 4.0]"
        assert result["moved"] == "ok: [2.0, 2.0]"
        assert result["cuda_device"] == "ok: 2.0"  # device="cuda", mapped to the host by compat
        assert result["cuda_moved"] == "ok: 2.0"  # .cuda(), the identity under compat


@pytest.mark.xdist_group("strict_device_rules")  # its module fixture, built once
@pytest.mark.slow
def test_host_derived_and_cpu_results_fail(rules):
    for result in rules:
        assert result["stacked"].startswith("error:"), result["stacked"]
        assert result["cpu_result"].startswith("error:"), result["cpu_result"]
        assert result["all_gather_host"].startswith("error: torch.distributed.all_gather ")


@pytest.mark.xdist_group("strict_device_rules")  # its module fixture, built once
@pytest.mark.slow
def test_gloo_groups_accept_host_tensors(rules):
    for result in rules:
        assert result["gloo_group_host"] == "ok: [2.0, 2.0]"
        assert result["plain_group_host"].startswith("error:")
        assert result["real_backends"] == ["gloo", "nccl", "nccl"]


@pytest.mark.xdist_group("strict_device_rules")  # its module fixture, built once
@pytest.mark.slow
def test_p2p_ops_checked(rules):
    for result in rules:
        assert result["p2p_host"].startswith("error: torch.distributed.batch_isend_irecv ")
    assert rules[1]["p2p_device"] == "ok: [0.0, 0.0]"  # rank 1 received rank 0's zeros


@pytest.mark.xdist_group("strict_device_rules")  # its module fixture, built once
@pytest.mark.slow
def test_strict_mode_composes_with_compat(rules):
    for result in rules:
        assert result["top_mode"] == "HostTrackingMode"
        assert "CudaToCpuMode" in result["modes"]


def plain_worker(args: dict) -> dict:
    tensor = torch.zeros(()) + 1
    torch.distributed.all_reduce(tensor)
    return {"installed": sd.is_installed(), "sum": tensor.item()}


@pytest.mark.slow
def test_strict_mode_is_opt_in(monkeypatch):
    monkeypatch.delenv(sd.ENV_VAR, raising=False)
    for result in run_distributed("tests.test_strict_devices:plain_worker", 2):
        assert result == {"installed": False, "sum": 2.0}


# ---------------------------------------------------------------- the bug that motivated it


def _old_agree(values: list) -> list:
    """The old pipeline loss agreement: non-last stages have no values and used to build their
    share on the host, then all-reduced it on the (NCCL) data-parallel group."""
    local = torch.stack(values).sum() if values else torch.zeros(())
    count = float(len(values))
    packed = torch.stack([local, torch.tensor(count, device=local.device),
                          torch.tensor(0.0, device=local.device)])
    torch.distributed.all_reduce(packed)
    return packed.tolist()


def old_loss_worker(args: dict) -> dict:
    """Rank 0 is a non-last pipeline stage (no losses); rank 1 the last one."""
    rank = torch.distributed.get_rank()
    values = [] if rank == 0 else [torch.tensor(2.0, device="cpu"), torch.tensor(3.0, device="cpu")]
    try:
        return {"installed": sd.is_installed(), "ok": _old_agree(values)}
    except sd.DeviceRuleError as exc:
        # keep rank 1's all-reduce from waiting forever: take part with a device tensor
        torch.distributed.all_reduce(torch.zeros(3, device="cpu"))
        return {"installed": sd.is_installed(), "error": str(exc)}


@pytest.mark.slow
def test_old_loss_agreement_fails_on_the_stage_without_losses(monkeypatch):
    monkeypatch.setenv(sd.ENV_VAR, "1")  # tests/helpers/dist.py's worker: install_if_requested()
    rank0, rank1 = run_distributed("tests.test_strict_devices:old_loss_worker", 2)
    assert rank0["installed"] and rank1["installed"]
    assert "torch.distributed.all_reduce" in rank0["error"]
    assert f"created at {HERE}:" in rank0["error"]
    assert rank1 == {"installed": True, "ok": [5.0, 2.0, 0.0]}
