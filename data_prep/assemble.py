"""Place BOS/EOD around every document's ids and convert them to the shard dtype."""

from __future__ import annotations

import numpy as np

UINT16_VOCAB_LIMIT = 65500
"""Megatron-Core's rule (DType.optimal_dtype): uint16 below this vocabulary size, else int32."""
LOOP_MIN_MEAN_LENGTH = 64
"""Documents at least this long on average are copied one slice each; shorter ones vectorized."""


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def _copy_by_slices(out: np.ndarray, flat: np.ndarray, lengths: np.ndarray, eod: int, bos: int) -> None:
    src = dst = 0
    for n in lengths.tolist():
        if bos >= 0:
            out[dst] = bos
            dst += 1
        out[dst:dst + n] = flat[src:src + n]
        src += n
        dst += n
        if eod >= 0:
            out[dst] = eod
            dst += 1


def _copy_vectorized(out: np.ndarray, flat: np.ndarray, lengths: np.ndarray, eod: int, bos: int) -> None:
    extra = (eod >= 0) + (bos >= 0)
    shift = np.repeat(np.arange(len(lengths), dtype=np.int64) * extra + (bos >= 0), lengths)
    out[np.arange(len(flat), dtype=np.int64) + shift] = flat
    ends = np.cumsum(lengths + extra)
    if eod >= 0:
        out[ends - 1] = eod
    if bos >= 0:
        out[ends - lengths - extra] = bos


def with_specials(flat: np.ndarray, lengths: np.ndarray, dtype, eod: int, bos: int):
    """(ids, per-document lengths) with ``bos`` before and ``eod`` after each document (-1 = none)."""
    extra = (eod >= 0) + (bos >= 0)
    if extra == 0:
        return flat.astype(dtype, copy=False), lengths.astype(np.int32)
    out = np.empty(len(flat) + extra * len(lengths), dtype=dtype)
    if len(lengths) and len(flat) >= LOOP_MIN_MEAN_LENGTH * len(lengths):
        _copy_by_slices(out, flat, lengths, eod, bos)
    else:
        _copy_vectorized(out, flat, lengths, eod, bos)
    return out, (lengths + extra).astype(np.int32)
