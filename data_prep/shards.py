"""Write Megatron-Core indexed-dataset shards crash-safely.

The ``.bin`` is the documents' ids back to back; the ``.idx`` is byte-identical to what
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` writes for one sequence per
document (tests compare the two). Both are written under ``*.tmp`` names, fsynced, then renamed
(.bin first, .idx last) and the directory fsynced, so a final name never holds a partial file.
"""

from __future__ import annotations

import os
import struct
from typing import Callable, Dict, List

import numpy as np

from data_prep.crc import crc32, crc32_combine
from launcher.core.atomic import fsync_dir

INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
               np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.float64): 6,
               np.dtype(np.float32): 7, np.dtype(np.uint16): 8}
TMP_SUFFIX = ".tmp"


def index_bytes(lengths: np.ndarray, dtype, document_indices=None) -> bytes:
    """The .idx contents for sequences of ``lengths`` ids; ``document_indices``: where each
    document starts among them, and their count last (default: one sequence per document)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    if document_indices is None:
        document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
    document_indices = np.asarray(document_indices, dtype=np.int64)
    return b"".join([INDEX_HEADER, struct.pack("<Q", 1), struct.pack("<B", DTYPE_CODES[np.dtype(dtype)]),
                     struct.pack("<Q", len(lengths)), struct.pack("<Q", len(document_indices)),
                     lengths.tobytes(), pointers.tobytes(), document_indices.tobytes()])


class ShardWriter:
    """One shard being written: ids go to ``<prefix>.bin.tmp``, written by this process (from
    memory) or by the worker process that made them, at the offset :meth:`add_placed` gives it;
    lengths stay in memory. ``settle(path)`` waits until the workers' writes to ``path`` are done."""

    def __init__(self, out_dir: str, prefix: str, dtype, settle: Callable[[str], None] = lambda path: None) -> None:
        self.out_dir, self.prefix, self.dtype = out_dir, prefix, np.dtype(dtype)
        self.bin_path = os.path.join(out_dir, prefix + ".bin")
        self.idx_path = os.path.join(out_dir, prefix + ".idx")
        self.tmp_path = self.bin_path + TMP_SUFFIX
        self._handle = open(self.tmp_path, "wb", buffering=0)
        self._settle = settle
        self._crc = 0
        self._lengths: List[np.ndarray] = []
        self._row_sizes: List[np.ndarray] = []
        self.tokens = 0
        self.documents = 0

    @property
    def bin_bytes(self) -> int:
        return self.tokens * self.dtype.itemsize

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)).cast("B")
        self._crc = crc32(data, self._crc)
        while data:
            data = data[self._handle.write(data):]
        self._counted(len(tokens), lengths)

    def add_placed(self, token_count: int, crc32: int, lengths: np.ndarray,
                   place: Callable[[str, int], None]) -> None:
        """Count ids (``token_count``, CRC-32 ``crc32``) that ``place(path, offset)`` has another
        process write at the shard's current end."""
        nbytes = token_count * self.dtype.itemsize
        if nbytes:
            place(self.tmp_path, self.bin_bytes)
        self._crc = crc32_combine(self._crc, crc32, nbytes)
        self._counted(token_count, lengths)

    def add_rows(self, tokens: np.ndarray, lengths: np.ndarray, row_sizes: np.ndarray) -> None:
        """Sequences (``lengths``) grouped into documents of ``row_sizes`` sequences each (packed
        rows of conversations: the .idx's document indices say where each row starts)."""
        self._row_sizes.append(np.asarray(row_sizes, dtype=np.int64))
        self.add(tokens, lengths)

    def _document_indices(self, sequences: int):
        if not self._row_sizes:
            return None
        sizes = np.concatenate(self._row_sizes)
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def _counted(self, tokens: int, lengths: np.ndarray) -> None:
        self._lengths.append(lengths)
        self.tokens += tokens
        self.documents += len(lengths)

    def commit(self) -> Dict[str, object]:
        """Make the shard final; returns its manifest fields (sizes and CRC-32 of both files)."""
        self._settle(self.tmp_path)
        os.fsync(self._handle.fileno())
        self._handle.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        index = index_bytes(lengths, self.dtype, self._document_indices(len(lengths)))
        with open(self.idx_path + TMP_SUFFIX, "wb") as handle:
            handle.write(index)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(self.bin_path + TMP_SUFFIX, self.bin_path)
        os.replace(self.idx_path + TMP_SUFFIX, self.idx_path)
        fsync_dir(self.out_dir)
        return {"prefix": self.prefix, "documents": self.documents, "tokens": self.tokens,
                "bin_bytes": self.bin_bytes, "idx_bytes": len(index),
                "bin_crc32": self._crc, "idx_crc32": crc32(index)}

    def abandon(self) -> None:
        """Drop every file of this shard: it is not in the manifest (it had no documents, or the
        run stopped, perhaps inside :meth:`commit`, which a stop signal can interrupt between its
        two renames). A final name it had already reached goes too: no file stands under a final
        name that the manifest does not list, and a missing one is not an error that would hide
        why the run stopped."""
        self._handle.close()
        for path in (self.tmp_path, self.idx_path + TMP_SUFFIX, self.bin_path, self.idx_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
