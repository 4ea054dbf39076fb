"""Greedy generation for ``generate_until`` tasks, batched over rows and replicas:
:func:`generate_rows`.

Every rank holds the same requests (lm-evaluation-harness builds them on every rank). The rows
go longest first and are dealt to the data-parallel replicas in turn; each replica generates
for its rows in batches (as many rows as a training micro-batch's tokens hold at their final
length), every replica running the same number of batches (an empty one holds one dummy row).
Each step is one forward pass of the batch (:meth:`Engine.next_tokens`: no KV cache, the whole
sequence again, as ``launcher.generate`` does); a row stops at its token budget or when its
``done`` says so (a stop string in its decoded text). A batch ends when no row of any replica's
batch of that round is still running (one all-reduce of a flag per step, so every rank runs
the same forward passes). Then one all-reduce over the world gives every rank every row's
tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from launcher.parallel import collectives


def generate_rows(engine, prompts: Sequence[list], budgets: Sequence[int],
                  done: Callable[[int, list], bool], *, seq: int,
                  micro_batch: int) -> list[list[int]]:
    """The generated ids of every row (``prompts[i]`` continued greedily for at most
    ``budgets[i]`` tokens, or until ``done(i, new ids)``), on every rank (collective)."""
    dp_rank, dp = engine.data_parallel()
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]) - budgets[i], i))
    longest = max((len(prompts[i]) + budgets[i] for i in order), default=1)
    per_batch = max(1, micro_batch * seq // max(1, longest))
    mine = order[dp_rank::dp]
    rounds = max(1, math.ceil(math.ceil(len(order) / dp) / per_batch))
    out: dict[int, list] = {}
    for r in range(rounds):
        rows = mine[r * per_batch:(r + 1) * per_batch]
        out.update(_one_batch(engine, rows, prompts, budgets, done))
    return _shared(out, len(prompts), max(budgets, default=0), dp)


def _one_batch(engine, rows: list, prompts, budgets, done) -> dict:
    """{row: its generated ids} of this replica's ``rows`` (empty: a dummy row that only keeps
    this replica in step)."""
    seqs = [list(prompts[i]) for i in rows] or [[0]]
    new: list[list[int]] = [[] for _ in seqs]
    running = [budgets[i] > 0 for i in rows] or [False]
    while collectives.any_rank(any(running)):
        ends = [len(s) for s in seqs]
        tokens = torch.zeros(len(seqs), max(ends), dtype=torch.int64)
        for k, s in enumerate(seqs):
            tokens[k, :len(s)] = torch.tensor(s)
        picked = engine.next_tokens(tokens, ends)
        for k, i in enumerate(rows):
            if not running[k]:
                continue
            seqs[k].append(picked[k])
            new[k].append(picked[k])
            running[k] = len(new[k]) < budgets[i] and not done(i, new[k])
    return {i: new[k] for k, i in enumerate(rows)}


def _shared(mine: dict, count: int, budget: int, dp: int) -> list[list[int]]:
    """Every row's ids on every rank: ids + 1 in a [count, budget] table (0: none), summed
    over the world. A row is one replica's, and each of the replica's ranks (its tensor-,
    pipeline- and context-parallel ranks) holds the same ids, so the sum is the ids + 1 times
    the ranks of a replica."""
    table = [0.0] * (count * budget)
    for i, ids in mine.items():
        for j, token in enumerate(ids):
            table[i * budget + j] = float(token + 1)
    per_replica = collectives.world_size() // dp
    summed = collectives.sum_floats(table) if table else []
    return [[round(v / per_replica) - 1 for v in summed[i * budget:(i + 1) * budget] if v > 0]
            for i in range(count)]
