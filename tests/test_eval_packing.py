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


def test_packed_rows_become_thd_sequences_padded_for_context_parallelism():
    """Under TE with CP=2 (every sequence split in 4 chunks): packed as Packing(L, 4), padded to
    a multiple of 4, then to_thd moves each row to an offset that is a multiple of 4 and the
    padding shrinks to what is left; every row keeps its tokens, labels, mask and row id, its
    positions from 0, and no row is refused as unpaddable."""
    import numpy as np
    import torch

    from launcher.engines.common import padded
    from launcher.engines.packed_rows import to_thd
    from launcher.evals.rows import Packing, replica_batches, row_length, score_plan

    rng = np.random.default_rng(5)
    rows = [(list(rng.integers(1, 99, int(n))), [7]) for n in rng.integers(2, 12, 16)]
    lengths = [row_length(c, x, 32) for c, x in rows]
    plan = score_plan(lengths, dp=1, seq=32, micro_batch=2, packing=Packing(32, 4))
    assert max(len(q) for step in plan for q in step.replicas[0]) >= 3
    for step, batch in zip(plan, replica_batches(rows, plan, 0)):
        batch = padded({k: torch.from_numpy(v) for k, v in batch.items()}, 4)
        flat, params = to_thd(batch, multiple=4)
        starts = params.cu_seqlens_q_padded.tolist()
        assert all(start % 4 == 0 for start in starts)
        for sequence in range(len(starts) - 1):
            part = slice(starts[sequence], starts[sequence + 1])
            positions = flat["position_ids"][0, part]
            assert (positions == torch.arange(len(positions))).all()
        for j, members in enumerate(step.replicas[0]):
            first = sum(len(q) for q in step.replicas[0][:j])
            for k in range(len(members)):
                mine_before = batch["row_ids"][j] == first + k
                mine_after = flat["row_ids"][0] == first + k
                for key in ("tokens", "labels", "loss_mask"):
                    before = batch[key][j][mine_before & (batch["loss_mask"][j] > 0)]
                    after = flat[key][0][mine_after & (flat["loss_mask"][0] > 0)]
                    assert torch.equal(before, after), (key, members[k])
