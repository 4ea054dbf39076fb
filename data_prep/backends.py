"""Encoders: one object per tokenizer library, all with the same batch interface.

``encode_batch(texts) -> (flat_ids, lengths)`` returns every document's token ids concatenated
(uint32) and the number of ids per document (int64). No special tokens are added here; EOD and BOS
are placed by :mod:`data_prep.assemble`. Text that happens to spell a special token (for example
``<|endoftext|>`` inside a tiktoken document) is encoded as ordinary text.
"""

from __future__ import annotations

import itertools
from typing import List, Sequence, Tuple

import numpy as np

Encoded = Tuple[np.ndarray, np.ndarray]


def _from_id_lists(id_lists: Sequence[Sequence[int]]) -> Encoded:
    lengths = np.fromiter((len(ids) for ids in id_lists), dtype=np.int64, count=len(id_lists))
    flat = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths


class ByteEncoder:
    """UTF-8 bytes are the tokens (0-255)."""

    name = "byte"

    def encode_batch(self, texts: List[str]) -> Encoded:
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        return np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.uint32), lengths

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class TiktokenEncoder:
    """tiktoken's own encoder (encode_ordinary: special-token text stays ordinary text)."""

    name = "tiktoken"

    def __init__(self, encoding) -> None:
        self.encoding = encoding

    def encode_batch(self, texts: List[str]) -> Encoded:
        return _from_id_lists(self.encoding.encode_ordinary_batch(texts, num_threads=1))

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])


class HFEncoder:
    """HuggingFace ``tokenizers`` (added tokens are matched, as the library does by default)."""

    name = "tokenizers"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode_batch(self, texts: List[str]) -> Encoded:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return _from_id_lists([e.ids for e in encodings])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceEncoder:
    """The ``sentencepiece`` library (no BOS/EOS added by encode)."""

    name = "sentencepiece"

    def __init__(self, processor) -> None:
        self.processor = processor

    def encode_batch(self, texts: List[str]) -> Encoded:
        return _from_id_lists(self.processor.encode(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode([int(i) for i in ids])


class GigatokenEncoder:
    """gigatoken's Rust encoder; documents spelling a special token go to the fallback instead.

    gigatoken always matches special tokens inside text, while tiktoken's encode_ordinary does not.
    A document yields a special id only if its text spells that special token, so the (rare)
    documents whose ids contain one are re-encoded by the library built by ``fallback_factory``.
    """

    name = "gigatoken"

    def __init__(self, tokenizer, parallel: bool, special_ids: Sequence[int] = (), fallback_factory=None):
        self.tokenizer = tokenizer
        self.parallel = parallel
        self.special_ids = np.array(sorted(special_ids), dtype=np.uint32)
        self.fallback_factory = fallback_factory
        self._fallback = None

    def encode_batch(self, texts: List[str]) -> Encoded:
        encoded = self.tokenizer.encode_batch(texts, parallel=self.parallel)
        layout = encoded.layout
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        flat = np.asarray(layout.content.data, dtype=np.uint32)[offsets[0]:offsets[-1]]
        lengths = np.diff(offsets)
        odd = self._documents_with_special_ids(flat, lengths)
        if odd:
            flat, lengths = self._reencode(texts, flat, lengths, odd)
        return flat, lengths

    def _documents_with_special_ids(self, flat: np.ndarray, lengths: np.ndarray) -> List[int]:
        if self.fallback_factory is None or not len(self.special_ids) or not len(flat):
            return []
        if flat.max() < self.special_ids[0]:
            return []
        positions = np.flatnonzero(np.isin(flat, self.special_ids))
        return np.unique(np.searchsorted(np.cumsum(lengths), positions, side="right")).tolist()

    def _reencode(self, texts: List[str], flat: np.ndarray, lengths: np.ndarray, odd: List[int]) -> Encoded:
        if self._fallback is None:
            self._fallback = self.fallback_factory()
        pieces = np.split(flat, np.cumsum(lengths)[:-1])
        redone_flat, redone_lengths = self._fallback.encode_batch([texts[i] for i in odd])
        redone = np.split(redone_flat, np.cumsum(redone_lengths)[:-1])
        for i, ids in zip(odd, redone):
            pieces[i] = ids
            lengths[i] = len(ids)
        return np.concatenate(pieces).astype(np.uint32), lengths

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(np.asarray(ids, dtype=np.uint32)).decode("utf-8", errors="replace")
