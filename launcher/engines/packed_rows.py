"""Packed rows as the attention takes them: conversations of ``data.format=chat``, and the scored
rows of an evaluation (:mod:`launcher.evals.rows`), both engines (:func:`on_the_device`).

A chat micro-batch (:mod:`launcher.runtime.chat_data`) is ``b`` rows of ``s`` tokens, each row
several conversations back to back and then padding, with ``position_ids`` that restart at 0
where a conversation (or the padding) starts and ``segment_ids`` that number them. (An
evaluation's packed micro-batch is the same, its padding continuing the last row's positions,
and it carries ``row_ids``, which follow the tokens wherever they go.) The data path carries
nothing quadratic in ``s``; what the attention needs is built here, per micro-batch, on the
device:

- Megatron-Core's local attention (the CPU path) takes an explicit mask:
  :func:`attention_cut` builds the ``[b, 1, s, s]`` one from the segment ids (causal, and never
  across segments; the padding attends to itself).
- Transformer Engine's attention takes no such mask; it runs packed sequences as one long
  sequence of ``t = b * s`` tokens (batch 1) with ``cu_seqlens``, the cumulative lengths of the
  sequences, and attends within each sequence only (Megatron-Core's ``PackedSeqParams`` with
  ``qkv_format="thd"``; its rotary embedding restarts per sequence from the same offsets).
  :func:`to_thd` turns the micro-batch into that form: tokens, labels, loss mask and positions
  as ``[1, t]``, and the ``PackedSeqParams`` whose sequences start where the positions restart
  (a row's padding is a sequence of its own: it attends only to itself, and its loss mask is
  0). Per-token sums are unchanged by the flattening, so the loss is the same.

**Context parallelism** (``multiple = 2 x CP``) splits every sequence into 2 x CP chunks, so each
must span a multiple of that. The rows of ``data_prep format=chat chat.pack_multiple=2xCP`` leave
room for it (each conversation packed at its length rounded up; the plan refuses other shards):
here each conversation of a row is moved to an offset that is a multiple, followed by padding
tokens that nothing attends to (``cu_seqlens`` holds the real lengths, ``cu_seqlens_padded`` the
offsets, as TE takes them), and the row's own padding takes what is left of the row. Then
Megatron-Core's ``get_thd_batch_on_this_cp_rank`` keeps this rank's chunks
(:func:`on_this_cp_rank`).
"""

from __future__ import annotations

import torch

FLATTENED = ("tokens", "labels", "loss_mask", "position_ids")
"""The ``[b, s]`` tensors of a chat micro-batch that become ``[1, b * s]``."""
CARRIED = ("row_ids",)
"""``[b, s]`` tensors that become ``[1, b * s]`` too where a micro-batch has them (scored rows:
launcher/evals/rows.py)."""


def attention_cut(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[b, 1, s, s]`` booleans, True where attention is cut (Megatron-Core's local attention
    convention), from ``[b, s]`` segment ids: a token sees the earlier tokens of its own
    segment only. Built where ``segment_ids`` lie (the device)."""
    s = segment_ids.shape[-1]
    future = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).triu_(1)
    return (segment_ids[:, None, :, None] != segment_ids[:, None, None, :]) | future


class UnpaddableRow(ValueError):
    """A row without room to pad its conversations to the context-parallel multiple."""


def sequence_lengths(positions: torch.Tensor) -> list:
    """The lengths of the sequences of one row's positions (each starts at position 0)."""
    starts = torch.nonzero(positions == 0).reshape(-1).tolist()
    if not starts or starts[0] != 0:
        raise ValueError("packed positions must start every row at 0 (a conversation or padding "
                         "starts each row)")
    return [end - start for start, end in zip(starts, starts[1:] + [len(positions)])]


def padded_lengths(lengths: list, multiple: int, row: int, padding: bool) -> list:
    """The room of each sequence: its length rounded up to ``multiple``; the last (the row's
    ``padding``, which may shrink, or a conversation that ends the row) takes the rest of the
    ``row`` tokens."""
    rounded = [-(-n // multiple) * multiple for n in lengths[:-1]]
    rest = row - sum(rounded)
    if rest < (0 if padding else lengths[-1]):
        raise UnpaddableRow(
            f"a row of conversations {lengths} cannot be padded to multiples of {multiple} "
            f"within {row} tokens: its shards were packed without room for it; re-run "
            f"data_prep format=chat with chat.pack_multiple={multiple}")
    return rounded + [rest]


def _cumulative(lengths: list) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)


def _padded_row(row: dict, lengths: list, room: list) -> dict:
    """One row's tensors with each sequence at the offset of its room, zeros after it
    (positions counting on)."""
    s = len(row["tokens"])
    out = {key: torch.zeros(s, dtype=row[key].dtype) for key in row}
    out["position_ids"] = torch.cat([torch.arange(n, dtype=row["position_ids"].dtype)
                                     for n in room])
    source = target = 0
    for n, space in zip(lengths, room):
        kept = min(n, space)  # the row's padding may shrink (its loss mask is 0)
        for key in row.keys() - {"position_ids"}:
            out[key][target:target + kept] = row[key][source:source + kept]
        source, target = source + n, target + space
    return out


def to_thd(batch: dict, multiple: int = 1):
    """(the micro-batch as one packed sequence of batch 1, its PackedSeqParams); ``batch`` is a
    chat micro-batch on the CPU (module docstring); ``multiple`` > 1 pads every sequence to a
    multiple of it (context parallelism). The offsets stay on the CPU until the batch moves
    (:func:`params_on`); ``max_seqlen`` is a Python int, as Megatron-Core wants it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    rows, lengths, room = [], [], []
    b, s = batch["tokens"].shape
    real = batch.get("real_tokens", torch.full((b,), s)).tolist()
    keys = FLATTENED + tuple(key for key in CARRIED if key in batch)
    for r in range(b):
        row = {key: batch[key][r] for key in keys}
        mine = sequence_lengths(row["position_ids"])
        space = mine if multiple == 1 else padded_lengths(mine, multiple, s, real[r] < s)
        rows.append(row if multiple == 1 else _padded_row(row, mine, space))
        kept = [(min(n, m), m) for n, m in zip(mine, space) if m]  # a padding shrunk to nothing
        lengths += [n for n, _ in kept]
        room += [m for _, m in kept]
    flat = {key: torch.cat([row[key] for row in rows])[None] for key in keys}
    cu_seqlens, longest = _cumulative(lengths), max(room)
    padded = None if multiple == 1 else _cumulative(room)
    return flat, PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
        max_seqlen_q=longest, max_seqlen_kv=longest)


def params_on(params, device: torch.device):
    """``params`` with its offsets on ``device`` (TE reads them there)."""
    import dataclasses

    moved = {name: getattr(params, name).to(device) for name in (
        "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
        if getattr(params, name) is not None}
    return dataclasses.replace(params, **moved)


def on_this_cp_rank(batch: dict, params) -> tuple:
    """(this context-parallel rank's chunks of every sequence, their PackedSeqParams):
    Megatron-Core's ``get_thd_batch_on_this_cp_rank`` (TE's partition kernel; on the device)."""
    from megatron.core.utils import get_thd_batch_on_this_cp_rank

    longest = torch.tensor([params.max_seqlen_q], dtype=torch.int32,
                           device=params.cu_seqlens_q.device)
    return get_thd_batch_on_this_cp_rank(batch, params.cu_seqlens_q, params.cu_seqlens_q_padded,
                                         longest)


def on_the_device(batch: dict, device: torch.device, *, thd: bool, cp: int) -> dict:
    """``batch`` (``[b, s]`` tensors on the host; ``segment_ids`` where its rows hold several
    sequences) as the model takes it, on ``device``, cut to this context-parallel rank's part:
    with segments, one THD sequence and its ``packed_seq_params`` when ``thd`` (Transformer
    Engine), else an ``attention_mask`` built on the device (:func:`attention_cut`)."""
    packed, batch = None, dict(batch)
    segments = batch.pop("segment_ids", None)
    if thd and segments is not None:
        batch, packed = to_thd(batch, multiple=2 * cp if cp > 1 else 1)
    batch = {k: v.to(device) for k, v in batch.items()}
    if segments is not None and packed is None:
        batch["attention_mask"] = attention_cut(segments.to(device))
    if packed is not None:
        packed = params_on(packed, device)
        if cp > 1:
            batch, packed = on_this_cp_rank(batch, packed)
        batch["packed_seq_params"] = packed
    elif cp > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank(batch)
    return batch
