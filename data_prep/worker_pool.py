"""Worker processes that read, parse and tokenize blocks on their own; the main process hands out
block descriptions (file, offsets) and takes back part descriptions, in block order.

No bulk data crosses a pipe and the main process copies no ids: workers read their input ranges
themselves, report each part's token count, and write its ids into the shard where the main process
places them (:mod:`data_prep.held_parts`). At most ``window`` blocks are out at once and a worker
holds a bounded amount of ids, so memory does not grow with the corpus. A worker that raises ends
the run with its exception; one that dies (a signal, the out-of-memory killer) with WorkerError.
"""

from __future__ import annotations

import multiprocessing
import selectors
import signal
import sys
from collections import defaultdict, deque
from typing import Dict, Iterable, Iterator, List, Set, Tuple

from data_prep.blocks import Block
from data_prep.errors import WorkerError
from data_prep.worker import PartResult
from data_prep.worker_process import worker_main

QUEUED_PER_WORKER = 2
"""Blocks sent to a worker ahead of the one it works on, so it never waits for the next."""


def _death(process) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        oom = " (SIGKILL is what the out-of-memory killer sends: lower workers= or block_bytes=)" \
            if -code == signal.SIGKILL else ""
        return f"killed by signal {name}{oom}"
    return f"exit code {code}"


def start_method() -> str:
    """``fork`` on Linux: a worker starts as a copy of the main process, which has already
    imported numpy, gigatoken, awkward and orjson and loaded the tokenizer, so it starts encoding
    at once (a spawned worker pays a fresh interpreter, ~0.3 s of imports and its own tokenizer
    load, ~0.5 CPU s each). The main process forks before it starts any thread of its own, and
    workers encode on their calling thread only (gigatoken's thread pool is never used after a
    fork). ``spawn`` elsewhere (macOS, where fork is unsafe with system frameworks)."""
    return "fork" if sys.platform.startswith("linux") else "spawn"


class WorkerPool:
    """``size`` worker processes; start them once the tokenizer is loaded, :meth:`init`, iterate
    :meth:`ordered_parts`, then :meth:`close`."""

    def __init__(self, size: int, method: str = "") -> None:
        context = multiprocessing.get_context(method or start_method())
        self.size = size
        self.window = 2 * size + 1
        self.conns, self.processes = [], []
        for _ in range(size):
            mine, theirs = context.Pipe()
            process = context.Process(target=worker_main, args=(theirs,), daemon=True)
            process.start()
            theirs.close()
            self.conns.append(mine)
            self.processes.append(process)
        self.events = selectors.DefaultSelector()
        """Every worker's pipe and exit sentinel, registered once: a wait costs the same for 2 or
        192 workers (multiprocessing's wait() registers every handle anew, ~300 us for 192)."""
        for worker, (conn, process) in enumerate(zip(self.conns, self.processes)):
            self.events.register(conn, selectors.EVENT_READ, (worker, False))
            self.events.register(process.sentinel, selectors.EVENT_READ, (worker, True))
        self.closed = False
        self.peak_rss: Dict[int, int] = {}
        """Worker pid -> the largest peak resident memory it reported (bytes)."""
        self.queued: List[deque] = [deque() for _ in range(size)]
        """Per worker: the blocks sent to it and not yet finished, in order."""
        self.arrived: Dict[int, deque] = defaultdict(deque)
        """Block index -> parts received and not yet yielded."""
        self.holder: Dict[Tuple[int, int], int] = {}
        """(block index, part) -> the worker holding its ids, until they are placed."""
        self.unplaced: Dict[str, int] = defaultdict(int)
        """Shard file -> place orders sent and not yet answered."""

    def init(self, info, settings: dict) -> None:
        for worker in range(self.size):  # a worker dead before it starts is a WorkerError too
            self._send(worker, ("init", info, settings), deque())

    def place(self, result: PartResult, path: str, offset: int) -> None:
        """Have the worker holding ``result``'s ids write them at ``offset`` of ``path``."""
        worker = self.holder.pop((result.index, result.part))
        self._send(worker, ("place", result.index, result.part, path, offset), self.queued[worker])
        self.unplaced[path] += 1

    def settle(self, path: str) -> None:
        """Wait until every id placed in ``path`` is written there."""
        while self.unplaced.get(path):
            self._receive()
        self.unplaced.pop(path, None)

    def ordered_parts(self, blocks: Iterable[Block], skips: Dict[int, int]) -> Iterator[Tuple[Block, PartResult]]:
        """(block, part) in block and part order; ``skips``: block index -> parts to skip."""
        source, queued, arrived = iter(blocks), self.queued, self.arrived
        out: deque = deque()  # blocks handed out and not yet fully yielded, in order
        exhausted = False
        while True:
            while not exhausted and len(out) < self.window:
                worker = min(range(self.size), key=lambda w: len(queued[w]))
                if len(queued[worker]) > QUEUED_PER_WORKER:
                    break
                block = next(source, None)
                if block is None:
                    exhausted = True
                    break
                queued[worker].append(block)
                self._send(worker, (block, skips.get(block.index, 0)), queued[worker])
                out.append(block)
            if not out:
                return
            waiting = arrived[out[0].index]
            if waiting:
                result = waiting.popleft()
                block = out[0]
                if result.last:
                    out.popleft()
                    del arrived[block.index]
                yield block, result
                continue
            self._receive()

    def _ready(self) -> Tuple[List[int], Set[int]]:
        """Wait until a worker has sent something or exited: (workers with messages, in order;
        workers that exited)."""
        talking, exited = set(), set()
        for key, _ in self.events.select():
            worker, is_sentinel = key.data
            (exited if is_sentinel else talking).add(worker)
        return sorted(talking), exited

    def _receive(self) -> None:
        """Wait for messages; store parts, count writes done, raise a worker's error or death."""
        queued = self.queued
        talking, exited = self._ready()
        for worker in talking:
            conn = self.conns[worker]
            while conn.poll():
                try:
                    kind, *body = conn.recv()
                except (EOFError, OSError):  # the worker is gone
                    self.processes[worker].join(timeout=5)
                    self._died(worker, queued[worker])
                if kind == "error":
                    raise body[1]
                if kind == "placed":
                    self.unplaced[body[0]] -= 1
                    continue
                self._arrived(worker, body[0])
        for worker in exited:
            if not self.conns[worker].poll():
                self.processes[worker].join()
                self._died(worker, queued[worker])

    def _arrived(self, worker: int, result: PartResult) -> None:
        pid = self.processes[worker].pid
        self.peak_rss[pid] = max(self.peak_rss.get(pid, 0), result.peak_rss)
        if result.token_count:
            self.holder[(result.index, result.part)] = worker
        self.arrived[result.index].append(result)
        if result.last:
            self.queued[worker].popleft()

    def _send(self, worker: int, message, queued: deque) -> None:
        try:
            self.conns[worker].send(message)
        except OSError:  # the worker is gone (a broken pipe)
            self.processes[worker].join(timeout=5)
            self._died(worker, queued)

    def _died(self, worker: int, queued: deque) -> None:
        process = self.processes[worker]
        doing = f" while preparing {queued[0].path} (block {queued[0].index})" if queued else ""
        raise WorkerError(f"a worker process died (pid {process.pid}, {_death(process)}){doing}; "
                          "nothing was committed after the last complete shard: re-run the same "
                          "command to resume")

    def close(self, wait_for_exit: bool = True) -> None:
        """Stop the workers: ask them to stop (or terminate them), then reap them; once."""
        if self.closed:
            return
        self.closed = True
        for conn, process in zip(self.conns, self.processes):
            try:
                if wait_for_exit and process.is_alive():
                    conn.send(None)
            except OSError:
                pass
        for process in self.processes:
            if not wait_for_exit:
                process.terminate()
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self.events.close()
        for conn in self.conns:
            conn.close()
