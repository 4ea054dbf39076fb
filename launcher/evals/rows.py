"""Scored rows as the engines' micro-batches, sized to the rows (numpy; the runtime makes tensors).

A row is (context ids, continuation ids). Its tokens are the last ``seq + 1`` of context +
continuation (the context cut from the left when too long): inputs the first ``n`` of them,
labels the next token of each, the loss mask set on the continuation's labels. A micro-batch
pads its rows to the longest of them, rounded up to :data:`LENGTH_MULTIPLE`, not to the
model's ``seq``: zeros after a row's end change nothing before it (a causal model's earlier
positions never see later ones), so a row scores the same in any micro-batch, at any length.

:func:`score_plan` (lm-evaluation-harness's HF backend sorts by length too) takes the rows
longest first. Each micro-batch holds as many rows as fit the token budget of a training
micro-batch (``micro_batch x seq`` tokens: the memory the run already has for it), so short
rows go many to a forward pass. Every data-parallel replica gets the same sequence of shapes,
each its share of the rows of a step of the plan (filler rows with an all-zero mask where rows
run out), so every rank runs the same forward passes and collectives, and a pipeline's stages
agree on every shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

LENGTH_MULTIPLE = 8
"""Micro-batch lengths are multiples of this (an engine rounds further where its layout needs
it: sequence parallelism, context parallelism)."""


@dataclass(frozen=True)
class ScoreBatch:
    """One forward pass of every replica: ``rows`` rows of ``length`` tokens each."""

    length: int
    rows: int
    replicas: tuple
    """Per replica, the indices of its rows (at most ``rows``; the rest are fillers)."""


def row_length(context: Sequence[int], continuation: Sequence[int], seq: int) -> int:
    """Input tokens of a row (its last ``seq + 1`` tokens less one; at least 1)."""
    return max(1, min(len(context) + len(continuation), seq + 1) - 1)


def row_arrays(context: Sequence[int], continuation: Sequence[int],
               seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, labels, loss_mask), each of length ``seq``, of one row."""
    tokens = np.zeros(seq, dtype=np.int64)
    labels = np.zeros(seq, dtype=np.int64)
    mask = np.zeros(seq, dtype=np.float32)
    full = (list(context) + list(continuation))[-(seq + 1):]
    n = len(full) - 1
    if n <= 0:
        return tokens, labels, mask
    tokens[:n], labels[:n] = full[:-1], full[1:]
    mask[n - min(len(continuation), n):n] = 1.0
    return tokens, labels, mask


def padded_length(tokens: int, seq: int) -> int:
    """The length a micro-batch whose longest row has ``tokens`` input tokens is padded to: a
    multiple of :data:`LENGTH_MULTIPLE`, at most ``seq`` (a row holds at most ``seq``)."""
    return min(seq, -(-tokens // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)


def score_plan(lengths: Sequence[int], *, dp: int, seq: int, micro_batch: int) -> list:
    """The :class:`ScoreBatch` es that score rows of input ``lengths`` on ``dp`` replicas:
    longest first; a step's length is its longest row's :func:`padded_length`; its rows per replica as many as ``micro_batch x seq`` tokens
    allow; the rows dealt to the replicas in turn. At least one step (every rank takes part)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    budget, plan, start = max(1, micro_batch) * seq, [], 0
    while start < len(order) or not plan:
        longest = lengths[order[start]] if start < len(order) else 1
        length = padded_length(longest, seq)
        rows = max(1, budget // length)
        taken = order[start:start + rows * dp]
        plan.append(ScoreBatch(length, min(rows, -(-len(taken) // dp) or 1),
                               tuple(tuple(taken[r::dp]) for r in range(dp))))
        start += rows * dp
    return plan


def computed_tokens(plan: Sequence[ScoreBatch], dp: int) -> int:
    """Tokens the forward passes of ``plan`` compute over every replica (fillers included)."""
    return sum(step.length * step.rows for step in plan) * dp


def replica_batches(rows: Sequence[tuple[Sequence[int], Sequence[int]]], plan: Sequence[ScoreBatch],
                    dp_rank: int) -> list[dict]:
    """Replica ``dp_rank``'s micro-batches of ``plan``: {tokens, labels, loss_mask,
    position_ids} arrays of shape [step.rows, step.length] (filler rows: all-zero mask)."""
    out = []
    for step in plan:
        mine = step.replicas[dp_rank]
        arrays = [row_arrays(*rows[i], step.length) for i in mine]
        arrays += [row_arrays([], [], step.length)] * (step.rows - len(mine))
        tokens, labels, mask = (np.stack(parts) for parts in zip(*arrays))
        positions = np.broadcast_to(np.arange(step.length, dtype=np.int64),
                                    (step.rows, step.length)).copy()
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask,
                    "position_ids": positions})
    return out
