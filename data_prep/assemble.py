"""Place BOS/EOD around every document's ids and convert them to the shard dtype."""

from __future__ import annotations

import numpy as np

UINT16_VOCAB_LIMIT = 65500
"""Megatron-Core's rule (DType.optimal_dtype): uint16 below this vocabulary size, else int32."""


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def with_specials(flat: np.ndarray, lengths: np.ndarray, dtype, eod: int, bos: int):
    """(ids, per-document lengths) with ``bos`` before and ``eod`` after each document (-1 = none)."""
    extra = (eod >= 0) + (bos >= 0)
    if extra == 0:
        return flat.astype(dtype, copy=False), lengths.astype(np.int32)
    new_lengths = lengths + extra
    ends = np.cumsum(new_lengths)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    special = np.zeros(len(out), dtype=bool)
    if eod >= 0:
        out[ends - 1] = eod
        special[ends - 1] = True
    if bos >= 0:
        out[ends - new_lengths] = bos
        special[ends - new_lengths] = True
    out[~special] = flat
    return out, new_lengths.astype(np.int32)
