"""Read gzip / zstd inputs with their integrity checked; every error names the file.

A compressed file that is cut short (an interrupted download or copy) or has damaged bytes is a
:class:`~data_prep.errors.CorruptInputError`, never a silent early end of the data:

* gzip: the stream must end with a complete member; each member's CRC-32 and length are checked
  (by :mod:`gzip`).
* zstd: the file must end exactly at the end of a frame (python-zstandard's ``stream_reader``
  returns a short read instead); damaged blocks and content checksums (written by the ``zstd``
  command-line tool by default) are checked by libzstd. Files of several concatenated frames
  (``pzstd``, ``cat a.zst b.zst``) are read frame after frame.

A zero-byte file reads as empty, as :mod:`gzip` reads it. Parquet files compress inside the file;
a parquet file pyarrow cannot read is reported the same way (:func:`unreadable_parquet`).
"""

from __future__ import annotations

import gzip
import zlib
from typing import BinaryIO, List

from data_prep.errors import CorruptInputError

ZSTD_FEED_BYTES = 16 * 1024
"""Compressed bytes handed to libzstd per step: output per step is at most this times the
compression ratio (libzstd returns all the output of what it is given at once)."""
FIX = "re-download or re-create the file, or leave it out of input="


def _corrupt(path: str, what: str, detail: object = "") -> CorruptInputError:
    detail = f" ({detail})" if str(detail) else ""
    return CorruptInputError(f"{path}: {what}{detail}; the file is damaged or incomplete: {FIX}")


def unreadable_parquet(path: str, exc: Exception) -> CorruptInputError:
    """The error for a parquet file pyarrow cannot read (parquet compresses inside the file)."""
    return _corrupt(path, "unreadable parquet file", exc)


class ZstdReader:
    """``read(size)`` of the decompressed bytes of an open zstd file ``raw``, frame after frame."""

    def __init__(self, raw: BinaryIO, path: str) -> None:
        import zstandard

        self.raw, self.path, self.zstd = raw, path, zstandard
        self.decoder = zstandard.ZstdDecompressor().decompressobj()
        self.in_frame = False
        """Bytes of the current frame have been fed but its end has not been seen."""
        self.pending: List[bytes] = []
        self.pending_bytes = 0
        self.at_end = False

    def _feed(self, data: bytes) -> None:
        while data:
            try:
                out = self.decoder.decompress(data)
            except self.zstd.ZstdError as exc:
                raise _corrupt(self.path, "corrupt zstd data", exc) from None
            if out:
                self.pending.append(out)
                self.pending_bytes += len(out)
            if not self.decoder.eof:
                self.in_frame = True
                return
            data = self.decoder.unused_data  # the next frame starts in the same feed
            self.decoder = self.zstd.ZstdDecompressor().decompressobj()
            self.in_frame = False

    def _fill(self, size: int) -> None:
        while self.pending_bytes < size and not self.at_end:
            data = self.raw.read(ZSTD_FEED_BYTES)
            if not data:
                self.at_end = True
                if self.in_frame:
                    raise _corrupt(self.path, "truncated zstd frame",
                                   f"the file ends inside a frame after {self.raw.tell():,} bytes")
                return
            self._feed(data)

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all the rest for -1); b"" only at the end of the file."""
        self._fill(size if size >= 0 else float("inf"))
        joined = b"".join(self.pending)
        size = len(joined) if size < 0 else size
        result, rest = joined[:size], joined[size:]
        self.pending, self.pending_bytes = ([rest] if rest else []), len(rest)
        return result


class GzipReader:
    """``read(size)`` of a gzip file whose errors (truncation, CRC, bad header) name it."""

    def __init__(self, raw: BinaryIO, path: str) -> None:
        self.reader, self.path = gzip.GzipFile(fileobj=raw, mode="rb"), path

    def read(self, size: int = -1) -> bytes:
        try:
            return self.reader.read(size)
        except EOFError:
            raise _corrupt(self.path, "truncated gzip stream",
                           "the file ends before the end-of-stream marker") from None
        except (gzip.BadGzipFile, zlib.error) as exc:
            raise _corrupt(self.path, "corrupt gzip data", exc) from None


def checked_reader(raw: BinaryIO, path: str, compression: str):
    """A reader of the decompressed bytes of the open file ``raw`` (``path`` names it in errors)."""
    if compression == "gz":
        return GzipReader(raw, path)
    if compression == "zst":
        return ZstdReader(raw, path)
    return raw


def read_whole(path: str, compression: str) -> bytes:
    """All decompressed bytes of ``path``."""
    with open(path, "rb") as raw:
        return checked_reader(raw, path, compression).read()
