"""(block, part) results in block order, from worker processes or from this process.

Results come back in block and part order whatever the number of workers, which is what makes
the output byte-identical for 1 or N workers.

* ``workers >= 2``: :class:`~data_prep.worker_pool.WorkerPool`; the workers write the token ids
  into the shards themselves, where the shard writer places them (:mod:`data_prep.held_parts`).
* ``workers == 1``: this process does the work in three stages, each a thread, joined by short
  queues: a reader thread reads and parses, a tokenizer thread encodes (with the tokenizer's own
  threads where there are more than two cores: :func:`encoder_threads`; the tokenizers release
  the GIL) and places EOD/BOS, and
  the calling thread writes the shards. The encoder never waits for the shard writes (CRC-32,
  copies into the file) nor the writes for the encoder, so the cores of a one-process run stay busy.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Dict, Iterable, Iterator, Optional, Tuple

from data_prep.blocks import Block
from data_prep.tokenizer_spec import build_encoder
from data_prep.worker import PartResult, block_parts, init_worker, parse_part, tokenize_into, warm_up
from data_prep.worker_pool import WorkerPool

_DONE = object()
PARSED_AHEAD = 2
"""Parsed parts waiting for the tokenizer thread (workers=1)."""
TOKENIZED_AHEAD = 1
"""Tokenized parts waiting for the shard writer (workers=1)."""
POLL_SECONDS = 0.1
"""How often a blocked stage checks whether the run has stopped (seconds)."""


def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
    """Put ``item`` unless the run has stopped; False when it has."""
    while not stop.is_set():
        try:
            out.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False


def _drain(source: queue.Queue, stop: threading.Event) -> Iterator:
    """The items of ``source`` up to _DONE; re-raises an exception a stage handed on."""
    while not stop.is_set():
        try:
            item = source.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
        if item is _DONE:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


def _produce(items: Iterator, out: queue.Queue, stop: threading.Event) -> None:
    """A stage thread: put every item in ``out``, then _DONE, or the exception that ended it."""
    try:
        for item in items:
            if not _put(out, item, stop):
                return
        _put(out, _DONE, stop)
    except BaseException as exc:  # handed to the next stage, which re-raises it
        _put(out, exc, stop)


def _parsed(blocks: Iterable[Block], skips: Dict[int, int]) -> Iterator[tuple]:
    for block in blocks:
        for number, part, last in block_parts(block, skips.get(block.index, 0)):
            yield (block, *parse_part(block, number, part, last))


def _tokenized(parsed: queue.Queue, stop: threading.Event) -> Iterator[Tuple[Block, PartResult]]:
    for block, result, texts in _drain(parsed, stop):
        yield block, tokenize_into(result, texts)


SERIAL_ENCODER_MAX_CORES = 2
"""Up to this many cores the one-process tokenizer thread encodes on its own thread."""


def encoder_threads() -> bool:
    """Whether the one-process run encodes on gigatoken's thread pool (one thread per core). On
    two cores the reader thread keeps one core busy parsing, and a pool thread on that core only
    competes with it: encoding on the tokenizer thread alone measured 0.95x the wall time of the
    pool (12 paired runs, 525 MB); with more cores the pool adds cores the parser does not use."""
    return len(os.sched_getaffinity(0)) > SERIAL_ENCODER_MAX_CORES


def _in_process(blocks: Iterable[Block], skips: Dict[int, int], init_args: tuple) -> Iterator[Tuple[Block, PartResult]]:
    init_worker(*init_args, parallel=encoder_threads())
    parsed: queue.Queue = queue.Queue(maxsize=PARSED_AHEAD)
    tokenized: queue.Queue = queue.Queue(maxsize=TOKENIZED_AHEAD)
    stop = threading.Event()
    stages = [threading.Thread(target=_produce, args=(items, out, stop), daemon=True)
              for items, out in ((_parsed(blocks, skips), parsed),
                                 (_tokenized(parsed, stop), tokenized))]
    for stage in stages:
        stage.start()
    try:
        yield from _drain(tokenized, stop)
    finally:
        stop.set()
        for stage in stages:
            stage.join(timeout=5)


def start_pool(workers: int, info) -> Optional[WorkerPool]:
    """None for ``workers <= 1`` (work then happens in the calling process); else ``workers``
    processes, started once this process has imported what encoding needs and loaded the
    encoder, so that forked workers inherit both (:func:`data_prep.worker_pool.start_method`)."""
    if workers <= 1:
        return None
    warm_up()
    build_encoder(info, parallel=False)
    return WorkerPool(workers)


def ordered_results(blocks: Iterable[Block], skips: Dict[int, int], pool: Optional[WorkerPool],
                    init_args: tuple) -> Iterator[Tuple[Block, PartResult]]:
    """(block, part) pairs in order; without a pool the work happens in this process.
    ``skips``: block index -> parts to skip (a resumed run); ``init_args``: (info, settings)."""
    if pool is None:
        return _in_process(blocks, skips, init_args)
    pool.init(*init_args)
    return pool.ordered_parts(blocks, skips)
