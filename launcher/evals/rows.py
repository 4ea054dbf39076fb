"""Scored rows as the engines' fixed-shape micro-batches (numpy; the runtime makes tensors).

A row is (context ids, continuation ids). It becomes one sequence of the model's length: the
last ``seq + 1`` tokens of context + continuation (the context cut from the left when too
long), inputs the first ``seq`` of them, labels the next token of each, the loss mask set on the
continuation's labels, and zeros after the end (a causal model's earlier positions never see
them). Data-parallel replica ``r`` of ``dp`` takes rows ``r, r + dp, ...``; every replica runs
the same number of micro-batches, the last ones filled with empty rows (mask all zero), so that
every rank issues the same collectives.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


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


def replica_rows(count: int, dp_rank: int, dp: int) -> list[int]:
    """Indices of the rows replica ``dp_rank`` of ``dp`` scores."""
    return list(range(dp_rank, count, dp))


def micro_batch_count(count: int, dp: int, micro_batch: int) -> int:
    """Micro-batches every replica runs for ``count`` rows (at least one)."""
    return max(1, math.ceil(math.ceil(count / dp) / micro_batch))


def micro_batches(rows: Sequence[tuple[Sequence[int], Sequence[int]]], indices: list[int],
                  *, seq: int, micro_batch: int, batches: int) -> list[dict]:
    """``batches`` micro-batches of ``micro_batch`` rows (those of ``indices``, then empty
    ones): {tokens, labels, loss_mask, position_ids} arrays of shape [micro_batch, seq]."""
    out = []
    for b in range(batches):
        chunk = indices[b * micro_batch:(b + 1) * micro_batch]
        arrays = [row_arrays(*rows[i], seq) for i in chunk]
        arrays += [row_arrays([], [], seq)] * (micro_batch - len(chunk))
        tokens, labels, mask = (np.stack(parts) for parts in zip(*arrays))
        positions = np.broadcast_to(np.arange(seq, dtype=np.int64), (micro_batch, seq)).copy()
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask,
                    "position_ids": positions})
    return out
