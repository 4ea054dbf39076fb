"""Scores of rows packed several to a sequence against the same rows alone, through the Megatron
engine's scoring (tests/test_eval_packing.py on CPU, tests/test_gpu_chat_thd.py under THD)."""

from __future__ import annotations

import numpy as np

from launcher.evals.rows import Packing, replica_batches, row_length, score_plan, scored_rows


def score_packed_and_alone(gpt, device, *, seq: int, vocab: int, pack: int) -> tuple:
    """({row: (logprob, misses)} packed into ``pack``-token sequences, the same one row a
    sequence, the plan packed): 14 rows of 3-20 tokens, a third of them continuations of 1."""
    import torch

    from launcher.engines.megatron.scoring import score_batches

    rng = np.random.default_rng(3)
    rows = [(list(rng.integers(1, vocab, int(n))), list(rng.integers(1, vocab, 1 + i % 3)))
            for i, n in enumerate(rng.integers(2, 18, 14))]
    lengths = [row_length(c, x, seq) for c, x in rows]
    out, plans = [], []
    for packing in (Packing(pack), Packing()):
        plan = score_plan(lengths, dp=1, seq=seq, micro_batch=2, packing=packing)
        batches = [{k: torch.from_numpy(v) for k, v in b.items()}
                   for b in replica_batches(rows, plan, 0)]
        scores, got = score_batches([gpt], batches, device=device, vocab_size=vocab), {}
        for step, (logprob, misses) in zip(plan, scores):
            for j, row in enumerate(scored_rows(step, 0)):
                got[row] = (float(logprob[j]), float(misses[j]))
        out.append(got)
        plans.append(plan)
    return out[0], out[1], plans[0]
