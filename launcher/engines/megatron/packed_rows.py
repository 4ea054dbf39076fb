"""Packed conversation rows in Transformer Engine's THD layout (``data.format=chat`` with TE).

A chat micro-batch (:mod:`launcher.runtime.chat_data`) is ``b`` rows of ``s`` tokens, each row
several conversations back to back and then padding, with ``position_ids`` that restart at 0
where a conversation (or the padding) starts. Megatron-Core's local attention keeps them apart
with the explicit ``[1, s, s]`` mask the row carries. Transformer Engine's attention takes no
such mask; it runs packed sequences as one long sequence of ``t = b * s`` tokens (batch 1) with
``cu_seqlens``, the offsets where each sequence starts, and attends within each sequence only
(Megatron-Core's ``PackedSeqParams`` with ``qkv_format="thd"``; its rotary embedding restarts
per sequence from the same offsets).

:func:`to_thd` turns the micro-batch into that form: tokens, labels, loss mask and positions as
``[1, t]``, the mask dropped, and the ``PackedSeqParams`` whose sequences start where the
positions restart (a row's padding is a sequence of its own: it attends only to itself, and its
loss mask is 0). Per-token sums are unchanged by the flattening, so the loss is the same.

Context parallelism over THD needs every sequence padded to a multiple of 2 x CP inside the row
(``cu_seqlens_padded``), which these rows are not: it is refused before start
(:func:`launcher.engines.model.packed_attention_unavailable`).
"""

from __future__ import annotations

import torch

FLATTENED = ("tokens", "labels", "loss_mask", "position_ids")
"""The ``[b, s]`` tensors of a chat micro-batch that become ``[1, b * s]``."""


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` (int32, on the CPU) of the flattened ``[b, s]`` positions: the offset of
    every position 0 (each row starts one), then the total."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed positions must start every row at 0 (a conversation or padding "
                         "starts each row)")
    total = torch.tensor([flat.numel()], dtype=starts.dtype)
    return torch.cat([starts, total]).to(torch.int32)


def to_thd(batch: dict):
    """(the micro-batch as one packed sequence of batch 1, its PackedSeqParams); ``batch`` is a
    chat micro-batch on the CPU (module docstring). ``cu_seqlens`` stay on the CPU until the
    batch moves; ``max_seqlen`` is a Python int, as Megatron-Core wants it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = sequence_starts(batch["position_ids"].cpu())
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    flat = {key: value.reshape(1, -1) for key, value in batch.items() if key in FLATTENED}
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return flat, params


def params_on(params, device: torch.device):
    """``params`` with its offsets on ``device`` (TE reads them there)."""
    import dataclasses

    return dataclasses.replace(params, cu_seqlens_q=params.cu_seqlens_q.to(device),
                               cu_seqlens_kv=params.cu_seqlens_kv.to(device))
