"""(block, part) results in block order, from worker processes or from this process.

Results come back in block and part order whatever the number of workers, which is what makes
the output byte-identical for 1 or N workers.

* ``workers >= 2``: :class:`~data_prep.worker_pool.WorkerPool`; token ids arrive in spool files.
* ``workers == 1``: this process does the work with two threads: a reader thread reads and parses
  ahead (two parts at most) while the calling thread tokenizes with the tokenizer's own threads
  (gigatoken's ``parallel=True``; the tokenizers release the GIL), so the cores of a one-process
  run are all used.
"""

from __future__ import annotations

import queue
import threading
from typing import Dict, Iterable, Iterator, Optional, Tuple

from data_prep.blocks import Block
from data_prep.worker import PartResult, block_parts, init_worker, parse_part, tokenize_into
from data_prep.worker_pool import WorkerPool

_DONE = object()
PARSED_AHEAD = 2


def _put(parsed: queue.Queue, item, stop: threading.Event) -> bool:
    """Put ``item`` unless the consumer has stopped; False when it has."""
    while not stop.is_set():
        try:
            parsed.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _parse_ahead(blocks: Iterable[Block], skips: Dict[int, int], parsed: queue.Queue,
                 stop: threading.Event) -> None:
    """Reader thread: read and parse parts ahead of the tokenizer."""
    try:
        for block in blocks:
            for number, part, last in block_parts(block, skips.get(block.index, 0)):
                if not _put(parsed, (block, *parse_part(block, number, part, last)), stop):
                    return
        _put(parsed, _DONE, stop)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        _put(parsed, exc, stop)


def _in_process(blocks: Iterable[Block], skips: Dict[int, int], init_args: tuple) -> Iterator[Tuple[Block, PartResult]]:
    init_worker(*init_args, parallel=True)
    parsed: queue.Queue = queue.Queue(maxsize=PARSED_AHEAD)
    stop = threading.Event()
    reader = threading.Thread(target=_parse_ahead, args=(blocks, skips, parsed, stop), daemon=True)
    reader.start()
    try:
        while (item := parsed.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            block, result, texts = item
            yield block, tokenize_into(result, texts)
    finally:
        stop.set()
        reader.join(timeout=5)


def start_pool(workers: int) -> Optional[WorkerPool]:
    """Start ``workers`` processes now, importing their libraries while the caller goes on;
    None for ``workers <= 1`` (work then happens in the calling process)."""
    return WorkerPool(workers) if workers > 1 else None


def ordered_results(blocks: Iterable[Block], skips: Dict[int, int], pool: Optional[WorkerPool],
                    init_args: tuple, spool: str) -> Iterator[Tuple[Block, PartResult]]:
    """(block, part) pairs in order; without a pool the work happens in this process.
    ``skips``: block index -> parts to skip (a resumed run); ``init_args``: (info, settings)."""
    if pool is None:
        return _in_process(blocks, skips, init_args)
    pool.init(*init_args, spool)
    return pool.ordered_parts(blocks, skips)
