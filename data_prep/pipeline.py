"""Run blocks through worker processes, at most ``window`` at a time, and yield results in order.

Results come back in block order whatever the number of workers, which is what makes the output
byte-identical for 1 or N workers. A worker that raises or dies (killed, out of memory) ends the
run with :class:`~data_prep.errors.WorkerError`.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from collections import deque
from dataclasses import replace
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Iterable, Iterator, Optional, Tuple

from data_prep.blocks import Block
from data_prep.errors import WorkerError
from data_prep.worker import BlockResult, init_worker, parse_block, process_block_with, tokenize_into, warm_up


_DONE = object()


def _put(parsed: queue.Queue, item, stop: threading.Event) -> bool:
    """Put ``item`` unless the consumer has stopped; False when it has."""
    while not stop.is_set():
        try:
            parsed.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _parse_ahead(blocks: Iterable[Block], parsed: queue.Queue, stop: threading.Event) -> None:
    """Reader thread: read and parse blocks ahead of the tokenizer (two at most)."""
    try:
        for block in blocks:
            item = (block, *parse_block(block))
            block.data = None
            if not _put(parsed, item, stop):
                return
        _put(parsed, _DONE, stop)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        _put(parsed, exc, stop)


def _in_process(blocks: Iterable[Block], init_args: tuple) -> Iterator[Tuple[Block, BlockResult]]:
    """One process: a thread reads and parses while this thread tokenizes (the tokenizers
    release the GIL), so the two overlap."""
    init_worker(*init_args)
    parsed: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    reader = threading.Thread(target=_parse_ahead, args=(blocks, parsed, stop), daemon=True)
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


def start_pool(workers: int) -> Optional[ProcessPoolExecutor]:
    """Start ``workers`` processes now, importing their libraries while the caller goes on;
    None for ``workers <= 1`` (work then happens in the calling process)."""
    if workers <= 1:
        return None
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    for _ in range(workers):
        pool.submit(warm_up)
    return pool


def _in_pool(blocks: Iterable[Block], pool: ProcessPoolExecutor, workers: int,
             init_args: tuple) -> Iterator[Tuple[Block, BlockResult]]:
    window = 2 * workers + 1
    pending: deque = deque()
    try:
        for block in blocks:
            future = pool.submit(process_block_with, block, *init_args)  # pickled later, by the executor
            pending.append((replace(block, data=None), future))
            while len(pending) >= window:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    except BrokenProcessPool as exc:
        raise WorkerError(f"a worker process died ({exc}); nothing was committed after the last "
                          "complete shard: re-run the same command to resume") from None
    finally:
        pool.shutdown(wait=not pending, cancel_futures=True)


def ordered_results(blocks: Iterable[Block], pool: Optional[ProcessPoolExecutor], workers: int,
                    init_args: tuple) -> Iterator[Tuple[Block, BlockResult]]:
    """(block, result) pairs in block order; without a pool the work happens in this process."""
    if pool is None:
        return _in_process(blocks, init_args)
    return _in_pool(blocks, pool, workers, init_args)
