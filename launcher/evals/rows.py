"""Scored rows as the engines' micro-batches, packed several to a sequence (numpy; the runtime
makes tensors).

A row is (context ids, continuation ids). Its tokens are the last ``seq + 1`` of context +
continuation (the context cut from the left when too long): inputs the first ``n`` of them,
labels the next token of each, the loss mask set on the continuation's labels.

**Packed, not padded.** Rows go longest first (lm-evaluation-harness's HF backend sorts by
length too) and best-fit into sequences of :func:`packing_for`'s length: each row into the
sequence with the least room that still holds it, a new sequence when none does (a row longer
than the pack length gets one of its own). Within a sequence the rows lie back to back, each
with positions restarting at 0 and its own segment: the engine cuts attention between segments
(an explicit mask on Megatron-Core's local attention, THD sequences under Transformer Engine:
:mod:`launcher.engines.packed_rows`), so a row scores as it would alone. Zeros after
the last row change nothing before them (a causal model's earlier positions never see later
ones). ``row_ids`` number a micro-batch's rows (0, 1, ...) at each of their tokens: the engine
sums each row's scores by them, whatever layout its tokens take (flattened for THD, split for
context parallelism).

:func:`score_plan` then groups the sequences, longest first, into micro-batches of as many
sequences as fit the token budget of a training micro-batch (``micro_batch x seq`` tokens:
the memory the run already has for it), each padded to its longest sequence rounded up to
:data:`LENGTH_MULTIPLE`. Every data-parallel replica gets the same sequence of shapes, each its
share of the sequences of a step of the plan (filler sequences with an all-zero mask where
they run out), so every rank runs the same forward passes and collectives, and a pipeline's
stages agree on every shape.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from launcher.config import EvalConfig, ModelConfig
from launcher.shape.model import ResolvedModel

LENGTH_MULTIPLE = 8
"""Micro-batch lengths are multiples of this (an engine rounds further where its layout needs
it: sequence parallelism, context parallelism)."""

MASKED_ATTENTION_SHARE = 0.05
"""Packs under an explicit attention mask are kept short enough that attending over the whole
pack adds at most this share to a token's linear-layer FLOPs (:func:`packing_for`). Its
softmax and mask are memory-bound, so their cost exceeds the FLOP count: bench/eval_packing.py
measured packs of 0.25-0.6 x hidden alike on a CPU, all faster than one row a sequence."""


@dataclass(frozen=True)
class ScoreBatch:
    """One forward pass of every replica: ``rows`` sequences of ``length`` tokens each."""

    length: int
    rows: int
    replicas: tuple
    """Per replica, its sequences (at most ``rows``; the rest are fillers), each the indices of
    the scored rows packed into it, in order."""


@dataclass(frozen=True)
class Packing:
    """How rows share sequences (:func:`packing_for`)."""

    length: int = 0
    """Tokens of one packed sequence; 0 = a row per sequence (no packing)."""
    multiple: int = 1
    """Each row's room is its length rounded up to this (2 x CP under context parallelism:
    every sequence is split in 2 x CP chunks)."""


def packing_for(setting: int, *, seq: int, hidden: int, thd: bool, cp: int = 1,
                window: int = 0) -> Packing:
    """The :class:`Packing` of a model: ``setting`` (eval.pack_length; capped at ``seq``) when
    given; else ``seq`` where the attention takes THD sequences (Transformer Engine: its cost
    stays per row), and where it takes an explicit ``[s, s]`` mask (the local attention: its
    cost grows with the pack) the longest pack whose attention (about ``4 x length x hidden``
    FLOPs a token) adds at most :data:`MASKED_ATTENTION_SHARE` to the linear layers' (about
    ``24 x hidden^2``). None (a row per sequence) for a sliding window under THD, which is
    unchecked there, and for context parallelism without THD (which needs it)."""
    if (thd and window) or (cp > 1 and not thd):
        return Packing()
    multiple = 2 * cp if cp > 1 else 1
    if setting > 0:
        return Packing(min(setting, seq), multiple)
    if thd:
        return Packing(seq, multiple)
    share = int(MASKED_ATTENTION_SHARE * 24 * hidden / 4)
    return Packing(min(seq, max(LENGTH_MULTIPLE, share // LENGTH_MULTIPLE * LENGTH_MULTIPLE)))


def packing_of(ev: EvalConfig, model: ModelConfig, *, cp: int, te: bool) -> Packing:
    """:func:`packing_for` of a run's eval and model settings at context-parallel size ``cp``,
    ``te`` whether its attention is Transformer Engine's (THD sequences). A model built from
    local layers on such a machine (launcher/shape/model.py: ``local_layers``) takes no
    packed rows: its attention wants a mask, and the engines send packed rows to Transformer
    Engine as THD wherever it runs."""
    if te and ResolvedModel.of(model).local_layers:
        return Packing()
    return packing_for(ev.pack_length, seq=model.seq_length, hidden=model.hidden_size, thd=te,
                       cp=cp, window=model.window_size)


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
    """The length a micro-batch whose longest sequence has ``tokens`` input tokens is padded to:
    a multiple of :data:`LENGTH_MULTIPLE`, at most ``seq`` (a sequence holds at most ``seq``)."""
    return min(seq, -(-tokens // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)


def packed_sequences(lengths: Sequence[int], pack: int) -> list[tuple]:
    """The rows (indices into ``lengths``, each the room a row takes) of each sequence:
    best-fit decreasing into sequences of ``pack`` tokens (a longer row alone in its own);
    longest sequence first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    sequences: list[list] = []
    used: list[int] = []
    rooms: list[tuple[int, int]] = []  # (room left, sequence), sorted: the best fit by bisection
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(rooms, (n, -1))
        if at < len(rooms):
            room, s = rooms.pop(at)
            sequences[s].append(i)
        else:
            room, s = max(pack, n), len(sequences)
            sequences.append([i])
            used.append(0)
        used[s] += n
        if room - n > 0:
            bisect.insort(rooms, (room - n, s))
    ranked = sorted(range(len(sequences)), key=lambda s: (-used[s], s))
    return [tuple(sequences[s]) for s in ranked]


def score_plan(lengths: Sequence[int], *, dp: int, seq: int, micro_batch: int,
               packing: Packing = Packing()) -> list:
    """The :class:`ScoreBatch` es that score rows of input ``lengths`` on ``dp`` replicas, the
    rows packed as ``packing`` says (:func:`packed_sequences`): a step's length is its longest
    sequence's :func:`padded_length`; its sequences per replica as many as ``micro_batch x
    seq`` tokens allow; the sequences dealt to the replicas in turn. At least one step (every
    rank takes part)."""
    rooms = [-(-n // packing.multiple) * packing.multiple for n in lengths]
    sequences = packed_sequences(rooms, packing.length)
    used = [sum(rooms[i] for i in s) for s in sequences]
    budget, plan, start = max(1, micro_batch) * seq, [], 0
    while start < len(sequences) or not plan:
        length = padded_length(used[start] if start < len(sequences) else 1, seq)
        rows = max(1, budget // length)
        taken = sequences[start:start + rows * dp]
        plan.append(ScoreBatch(length, min(rows, -(-len(taken) // dp) or 1),
                               tuple(tuple(taken[r::dp]) for r in range(dp))))
        start += rows * dp
    return plan


def computed_tokens(plan: Sequence[ScoreBatch], dp: int) -> int:
    """Tokens the forward passes of ``plan`` compute over every replica (fillers included)."""
    return sum(step.length * step.rows for step in plan) * dp


def scored_rows(step: ScoreBatch, dp_rank: int) -> list[int]:
    """The rows replica ``dp_rank`` scores in ``step``, in the order of their ``row_ids``."""
    return [i for sequence in step.replicas[dp_rank] for i in sequence]


def _sequence_arrays(rows: Sequence, members: Sequence[int], length: int, first_id: int) -> dict:
    """One sequence of ``length`` tokens: the ``members`` rows back to back (positions
    restarting, a segment each, ``row_ids`` from ``first_id``), zeros after them, and
    ``real_tokens``, how many tokens the rows take."""
    out = {"tokens": np.zeros(length, np.int64), "labels": np.zeros(length, np.int64),
           "loss_mask": np.zeros(length, np.float32), "position_ids": np.zeros(length, np.int64),
           "segment_ids": np.zeros(length, np.int64), "row_ids": np.zeros(length, np.int64)}
    at = 0
    for k, i in enumerate(members):
        n = row_length(*rows[i], length)
        tokens, labels, mask = row_arrays(*rows[i], n)
        for key, part in (("tokens", tokens), ("labels", labels), ("loss_mask", mask)):
            out[key][at:at + n] = part
        out["position_ids"][at:at + n] = np.arange(n)
        out["segment_ids"][at:at + n] = k
        out["row_ids"][at:at + n] = first_id + k
        at += n
    out["real_tokens"] = np.int64(at)  # where the rows end: THD under CP may shrink the rest
    if members:  # the padding continues the last row (a causal row never sees it)
        out["position_ids"][at:] = np.arange(n, n + length - at)
        out["segment_ids"][at:], out["row_ids"][at:] = len(members) - 1, first_id + k
    else:  # a filler: positions from 0, row 0 with nothing masked in
        out["position_ids"][:] = np.arange(length)
    return out


def replica_batches(rows: Sequence[tuple[Sequence[int], Sequence[int]]], plan: Sequence[ScoreBatch],
                    dp_rank: int) -> list[dict]:
    """Replica ``dp_rank``'s micro-batches of ``plan``: {tokens, labels, loss_mask,
    position_ids, row_ids, and segment_ids where a sequence holds several rows} arrays of
    shape [step.rows, step.length] (filler sequences: all-zero mask), and with segment_ids
    ``real_tokens`` [step.rows], the tokens of each sequence's rows (the chat rows' own
    field: launcher/engines/packed_rows.py)."""
    out = []
    for step in plan:
        mine, first, parts = step.replicas[dp_rank], 0, []
        for members in list(mine) + [()] * (step.rows - len(mine)):
            parts.append(_sequence_arrays(rows, members, step.length, first))
            first += len(members)
        batch = {key: np.stack([p[key] for p in parts]) for key in parts[0]}
        if all(len(members) <= 1 for members in mine):  # causal attention as it is: no mask
            del batch["segment_ids"], batch["real_tokens"]
        out.append(batch)
    return out
