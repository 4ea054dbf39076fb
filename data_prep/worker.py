"""What one worker does with one block: read it, keep the valid texts, tokenize, add EOD/BOS.

Workers are plain functions over module state set once by :func:`init_worker` (the pool's
initializer, or the main process itself when ``workers=1``).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from data_prep import records
from data_prep.assemble import token_dtype, with_specials
from data_prep.blocks import Block, read_block_bytes
from data_prep.decompress import read_whole, unreadable_parquet
from data_prep.tokenizer_spec import TokenizerInfo, build_encoder

_STATE: dict = {}


@dataclass
class BlockResult:
    index: int
    tokens: np.ndarray
    """All ids of the block's documents, EOD/BOS included, in the shard dtype."""
    lengths: np.ndarray
    """Ids per document (int32)."""
    lines: int
    """Lines (rows) the block spans; lets the writer number lines of later blocks."""
    counts: Counter = field(default_factory=Counter)
    """Skip and repair reasons -> records."""
    examples: Dict[str, List[Tuple[str, int, str]]] = field(default_factory=dict)
    """reason -> (path, line, detail); line is relative to the block when first_line is 0."""
    failure: Optional[Tuple[str, int, str, str]] = None
    """strict=true: (path, line, reason, detail) of the first bad record."""
    input_bytes: int = 0
    text_bytes: int = 0


def warm_up() -> int:
    """Import what encoding needs while the main process is still resolving the tokenizer."""
    import awkward  # noqa: F401  (gigatoken returns awkward arrays)
    import gigatoken  # noqa: F401
    import orjson  # noqa: F401

    return os.getpid()


def init_worker(info: TokenizerInfo, settings: dict, parallel: bool = False) -> None:
    """Build this process's encoder; ``settings`` holds text_key, append_eod, prepend_bos,
    examples_per_reason and strict."""
    _STATE.clear()
    _STATE.update(settings)
    _STATE["key"] = (info, tuple(sorted(settings.items())))
    _STATE["encoder"] = build_encoder(info, parallel=parallel)
    _STATE["dtype"] = token_dtype(info.vocab_size)
    _STATE["eod"] = info.eod_id if settings["append_eod"] else -1
    _STATE["bos"] = info.bos_id if settings["prepend_bos"] else -1


def _parse(block: Block, sink: records.RecordSink) -> Tuple[int, List[Tuple[str, int, str]]]:
    """Fill ``sink``; returns (lines, examples of text_files blocks with their own paths)."""
    key = _STATE["text_key"]
    if block.fmt == "jsonl":
        return records.parse_jsonl(read_block_bytes(block), key, sink, block.at_file_end), []
    if block.fmt == "text_lines":
        return records.parse_text_lines(read_block_bytes(block), sink), []
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


def _parse_text_files(block: Block, sink: records.RecordSink) -> List[Tuple[str, int, str]]:
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


def process_block_with(block: Block, info: TokenizerInfo, settings: dict) -> BlockResult:
    """process_block in a pool worker, building the encoder on the first call."""
    if _STATE.get("key") != (info, tuple(sorted(settings.items()))):
        init_worker(info, settings)
    return process_block(block)


def parse_block(block: Block) -> Tuple[BlockResult, List[str]]:
    """First stage: read and check the records; the result still lacks tokens."""
    sink = records.RecordSink(_STATE["examples_per_reason"], _STATE["strict"])
    lines, located = _parse(block, sink)
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
    tokens, lengths = _empty()
    return BlockResult(block.index, tokens, lengths, lines, sink.counts, examples, failure,
                       block.input_bytes, sum(len(t) for t in texts)), texts


def tokenize_into(result: BlockResult, texts: List[str]) -> BlockResult:
    """Second stage: the documents' ids, with EOD/BOS, in the shard dtype."""
    if texts:
        result.tokens, result.lengths = _tokenize(texts)
    return result


def process_block(block: Block) -> BlockResult:
    return tokenize_into(*parse_block(block))


def _empty():
    return np.zeros(0, dtype=_STATE["dtype"]), np.zeros(0, dtype=np.int32)


def _tokenize(texts: List[str]):
    if not texts:
        return _empty()
    flat, lengths = _STATE["encoder"].encode_batch(texts)
    return with_specials(flat, lengths, _STATE["dtype"], _STATE["eod"], _STATE["bos"])
