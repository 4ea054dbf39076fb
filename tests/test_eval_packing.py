"""Scored rows packed several to a sequence (launcher/evals/rows.py) give every row the scores it
gets alone in its sequence: through Megatron-Core's forward-only schedule and the local
attention's explicit mask (launcher/engines/packed_rows.py: on_the_device), on a model with
rotary positions and one with learned absolute positions (which must restart at each row).
The GPU kit holds the same check for Transformer Engine's THD path
(tests/test_gpu_chat_thd.py)."""

from __future__ import annotations

import pytest

from launcher.config import Arch, ParallelismConfig
from tests.helpers.dist import gloo_group
from tests.helpers.models import build, in_process, small
from tests.helpers.scoring import score_packed_and_alone


@pytest.fixture(scope="module")
def megatron_tp1():
    with gloo_group():
        from launcher.engines.model import init_parallel_state

        init_parallel_state(ParallelismConfig(), seed=1234)
        yield


@in_process
@pytest.mark.parametrize("arch", [Arch.llama, Arch.gpt2])
def test_packed_rows_score_as_they_do_alone(megatron_tp1, arch):
    import torch

    gpt = build(small(arch=arch, seq_length=48, vocab_size=512))
    gpt.eval()
    packed, alone, plan = score_packed_and_alone(gpt, torch.device("cpu"), seq=48, vocab=512,
                                                 pack=48)
    assert max(len(q) for step in plan for q in step.replicas[0]) >= 3  # rows share sequences
    assert set(packed) == set(alone) == set(range(14))
    for row, (logprob, misses) in alone.items():
        assert packed[row][0] == pytest.approx(logprob, rel=1e-5, abs=1e-5), row
        assert packed[row][1] == misses, row
