"""Learning-rate schedules, checked with numbers."""

from __future__ import annotations

import math

import pytest

from launcher.config import OptimizerConfig, Schedule
from launcher.engines.common import set_lr
from launcher.runtime.schedule import lr_at, wsd_decay_start


def opt(schedule: Schedule, **kw) -> OptimizerConfig:
    return OptimizerConfig(lr=1.0, min_lr=0.1, schedule=schedule, **{"warmup_steps": 4, **kw})


@pytest.mark.parametrize("schedule", list(Schedule))
def test_linear_warmup_reaches_peak_on_last_warmup_step(schedule):
    o = opt(schedule)
    lrs = [lr_at(s, optimizer=o, total_steps=100) for s in range(4)]
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_cosine_numbers():
    o = opt(Schedule.cosine)  # 96 decay steps after 4 of warmup
    at = lambda s: lr_at(s, optimizer=o, total_steps=100)  # noqa: E731
    assert at(4) == pytest.approx(1.0)
    assert at(52) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert at(28) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert at(100) == pytest.approx(0.1) and at(500) == pytest.approx(0.1)
    lrs = [at(s) for s in range(4, 100)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))


def test_wsd_numbers():
    o = opt(Schedule.wsd, decay_fraction=0.2)  # decay over steps 80..99
    at = lambda s: lr_at(s, optimizer=o, total_steps=100)  # noqa: E731
    assert wsd_decay_start(o, 100) == 80
    assert [at(s) for s in (4, 50, 79)] == [1.0, 1.0, 1.0]
    assert at(80) == pytest.approx(1.0 - 0.9 / 20)
    assert at(89) == pytest.approx(1.0 - 0.9 * 10 / 20)
    assert at(99) == pytest.approx(0.1)


def test_wsd_decay_never_starts_inside_warmup():
    o = opt(Schedule.wsd, decay_fraction=0.9, warmup_steps=5)
    assert wsd_decay_start(o, 10) == 5
    assert lr_at(4, optimizer=o, total_steps=10) == pytest.approx(1.0)
    assert lr_at(9, optimizer=o, total_steps=10) == pytest.approx(0.1)


def test_constant_and_no_warmup():
    o = opt(Schedule.constant, warmup_steps=0)
    assert {lr_at(s, optimizer=o, total_steps=10) for s in range(10)} == {1.0}
    c = opt(Schedule.cosine, warmup_steps=0)
    assert lr_at(0, optimizer=c, total_steps=10) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        lr_at(-1, optimizer=c, total_steps=10)


def test_set_lr_writes_every_group():
    import torch

    p = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    o = torch.optim.AdamW([{"params": [p[0]]}, {"params": [p[1]], "weight_decay": 0.0}], lr=1.0)
    set_lr(o, 0.125)
    assert [g["lr"] for g in o.param_groups] == [0.125, 0.125]
