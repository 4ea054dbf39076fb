"""What a worker does with one block: read it part by part, keep the valid texts, tokenize, add
EOD/BOS. The same functions run in a worker process (:mod:`data_prep.worker_process`) and, for
``workers=1``, in the main process (:mod:`data_prep.pipeline`).

Workers are plain functions over module state set once by :func:`init_worker`.
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from data_prep import records
from data_prep.assemble import token_dtype, with_specials
from data_prep.blocks import Block
from data_prep.decompress import read_whole, unreadable_parquet
from data_prep.parts import Part, iter_parts
from data_prep.tokenizer_spec import TokenizerInfo, build_encoder

_STATE: dict = {}


@dataclass
class PartResult:
    index: int
    """The block's index."""
    part: int
    """The part's number within its block (0-based)."""
    last: bool
    """The block's last part."""
    lengths: np.ndarray
    """Ids per document (int32), EOD/BOS included."""
    lines: int
    """Lines (rows) the part spans; lets the writer number lines of later parts."""
    counts: Counter = field(default_factory=Counter)
    """Skip and repair reasons -> records."""
    examples: Dict[str, List[Tuple[str, int, str]]] = field(default_factory=dict)
    """reason -> (path, line, detail); line is relative to the part when first_line is 0."""
    failure: Optional[Tuple[str, int, str, str]] = None
    """strict=true: (path, line, reason, detail) of the first bad record."""
    input_bytes: int = 0
    text_bytes: int = 0
    tokens: Optional[np.ndarray] = None
    """All ids of the part's documents in the shard dtype (main process), or None when the worker
    process that made them holds them until it writes them into the shard (data_prep.held_parts)."""
    token_count: int = 0
    crc32: int = 0
    """CRC-32 of the ids' bytes (worker process)."""
    peak_rss: int = 0
    """Peak resident memory of the process that made this part (bytes)."""


def warm_up() -> int:
    """Import what encoding needs while the main process is still resolving the tokenizer."""
    import awkward  # noqa: F401  (gigatoken returns awkward arrays)
    import gigatoken  # noqa: F401
    import orjson  # noqa: F401

    return os.getpid()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc mallopt() parameters (malloc.h)."""
REUSED_ALLOCATION_BYTES = 32 * 1024 * 1024
"""Allocations up to this size come from malloc's heap (glibc's largest mmap threshold)."""
KEPT_FREE_BYTES = 256 * 1024 * 1024
"""Freed heap memory malloc keeps for reuse instead of returning it to the system."""


def keep_freed_memory() -> None:
    """Let glibc's malloc reuse the memory of a part's buffers (read data, texts, token ids, a few
    MB each) for the next part instead of unmapping it and faulting in fresh zeroed pages (less
    than half the page faults of a one-process run); the peak memory is unchanged. No-op without
    glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, REUSED_ALLOCATION_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
    except (AttributeError, OSError):
        pass


def init_worker(info: TokenizerInfo, settings: dict, parallel: bool = False) -> None:
    """Build this process's encoder; ``settings`` holds text_key, append_eod, prepend_bos,
    examples_per_reason, strict and part_bytes; ``parallel`` lets gigatoken use every core."""
    keep_freed_memory()
    _STATE.clear()
    _STATE.update(settings)
    _STATE["encoder"] = build_encoder(info, parallel=parallel)
    _STATE["dtype"] = token_dtype(info.vocab_size)
    _STATE["eod"] = info.eod_id if settings["append_eod"] else -1
    _STATE["bos"] = info.bos_id if settings["prepend_bos"] else -1


def parse_into(block: Block, part: Optional[Part], sink: records.RecordSink) -> Tuple[int, list]:
    """Fill ``sink`` from ``part`` of ``block`` (None for parquet / whole-file blocks); returns
    (lines, examples of text_files blocks with their own paths)."""
    key = _STATE["text_key"]
    if block.fmt == "jsonl":
        return records.parse_jsonl(part.data, key, sink, part.at_file_end), []
    if block.fmt == "text_lines":
        return records.parse_text_lines(part.data, sink), []
    if block.fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(block.path).read_row_group(block.start, columns=[key])
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise unreadable_parquet(block.path, exc) from None
        values = table.column(0).to_pylist()
        records.parse_column(values, key, sink)
        return len(values), []
    return 0, _parse_text_files(block, sink)


def _parse_text_files(block: Block, sink: records.RecordSink) -> List[Tuple[str, str, int, str]]:
    located = []
    for path, compression in block.files:
        before = {reason: len(kept) for reason, kept in sink.examples.items()}
        records.parse_text_file(read_whole(path, compression), sink)
        for reason, kept in sink.examples.items():
            located += [(reason, path, line, detail) for line, detail in kept[before.get(reason, 0):]]
        if sink.failure:
            sink.failure = (path,) + sink.failure
            break
    sink.examples = {}
    return located


def block_parts(block: Block, skip: int = 0) -> Iterator[Tuple[int, Optional[Part], bool]]:
    """(number, part, last) of every part of ``block`` from part ``skip`` on (a resumed run skips
    the parts its committed shards already hold); parquet and whole-file blocks are one part."""
    if block.fmt not in ("jsonl", "text_lines"):
        yield 0, None, True
        return
    for number, (part, last) in enumerate(iter_parts(block, _STATE["part_bytes"])):
        if number >= skip:
            yield number, part, last


def parse_part(block: Block, number: int, part: Optional[Part], last: bool) -> Tuple[PartResult, List[str]]:
    """First stage: read and check the records; the result still lacks tokens."""
    sink = records.RecordSink(_STATE["examples_per_reason"], _STATE["strict"])
    lines, located = parse_into(block, part, sink)
    offset = block.first_line - 1 if block.first_line else 0
    examples: Dict[str, List[Tuple[str, int, str]]] = {}
    for reason, kept in sink.examples.items():
        examples[reason] = [(block.path, line + offset, detail) for line, detail in kept]
    for reason, path, line, detail in located:
        examples.setdefault(reason, []).append((path, line, detail))
    failure = None
    if sink.failure:
        failure = sink.failure if len(sink.failure) == 4 else (block.path, sink.failure[0] + offset,
                                                                sink.failure[1], sink.failure[2])
    texts = [] if failure else sink.texts
    input_bytes = part.input_bytes if part is not None else block.input_bytes
    return PartResult(block.index, number, last, np.zeros(0, np.int32), lines, sink.counts, examples,
                      failure, input_bytes, sum(len(t) for t in texts)), texts


def tokenize_into(result: PartResult, texts: List[str]) -> PartResult:
    """Second stage: the documents' ids, with EOD/BOS, in the shard dtype."""
    result.tokens = np.zeros(0, dtype=_STATE["dtype"])
    if texts:
        flat, lengths = _STATE["encoder"].encode_batch(texts)
        result.tokens, result.lengths = with_specials(flat, lengths, _STATE["dtype"], _STATE["eod"],
                                                      _STATE["bos"])
    result.token_count = len(result.tokens)
    return result
