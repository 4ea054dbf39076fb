"""The optimizer state a Megatron-Core read fills is allocated without an optimizer step, and
equals what torch's own first step allocates (the state a stepped prime leaves): same keys,
dtypes, shapes, devices and zero values; fails when torch's Adam changes what it keeps."""

from __future__ import annotations

import pytest
import torch

from launcher.engines.megatron.checkpoint import _ADAM_STATE, allocate_adam_state


def _params() -> list:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(7)),
            torch.nn.Parameter(torch.empty(0))]


def _stepped(cls, **kwargs) -> dict:
    """The state of a zero-gradient step at lr 0 with the moments and steps zeroed after (the
    prime of an optimizer that :func:`allocate_adam_state` declines), per parameter index."""
    params = _params()
    adam = cls(params, lr=0.0, weight_decay=0.0, **kwargs)
    for p in params:
        if p.numel():  # Megatron-Core gives empty parameters no gradient
            p.grad = torch.zeros_like(p)
    adam.step()
    for state in adam.state.values():
        for key in _ADAM_STATE:
            if torch.is_tensor(state.get(key)):
                state[key].zero_()
    return {i: adam.state[p] for i, p in enumerate(params) if p in adam.state}


def _allocated(cls, **kwargs) -> tuple:
    params = _params()
    adam = cls(params, lr=1e-3, **kwargs)
    done = allocate_adam_state(adam)
    return done, {i: adam.state[p] for i, p in enumerate(params) if p in adam.state}, params


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_allocated_adam_state_equals_the_state_of_a_first_step(cls, amsgrad):
    done, allocated, params = _allocated(cls, amsgrad=amsgrad)
    reference = _stepped(cls, amsgrad=amsgrad)
    assert done
    assert sorted(allocated) == sorted(reference) == [0, 1]
    for i, state in reference.items():
        assert sorted(allocated[i]) == sorted(state)
        for key, value in state.items():
            got = allocated[i][key]
            assert (got.dtype, got.shape, got.device) == (value.dtype, value.shape, value.device)
            assert torch.equal(got, value), key
    assert torch.equal(params[0], _params()[0])  # the weights are untouched


def test_another_optimizer_is_left_to_the_stepped_prime():
    assert not allocate_adam_state(torch.optim.SGD(_params(), lr=0.1))
    assert not allocate_adam_state(torch.optim.Adam(_params(), lr=0.1, capturable=True))
