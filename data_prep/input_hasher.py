"""sha256 of every input file (the manifest records them), computed by processes of their own.

The main process starts them as soon as the inputs are known, before it loads the tokenizer: the
hashing (~0.3 CPU s per 500 MB with the CPU's SHA instructions) then runs on cores that would
otherwise wait for the main process's start-up, instead of competing with the tokenizer for the
cores later. Processes, not threads: the worker processes are forked after they start
(data_prep.worker_pool), and a process that forks should have no other thread of its own.

One sha256 runs on one core (a file's digest cannot be split), at about 2 GB/s with SHA
instructions and 0.5 GB/s without, while a tokenizing worker reads about 0.18 GB/s of JSONL. So
one process hashes for every :data:`WORKERS_PER_HASHER` workers, each process taking whole files
(balanced by bytes); otherwise a single hasher would be what a run of many cores waits for.
"""

from __future__ import annotations

import heapq
import multiprocessing
import signal
from typing import Dict, List, Sequence

from data_prep.errors import WorkerError
from data_prep.manifest import file_sha256
from data_prep.worker_pool import start_method
from data_prep.worker_process import name_this_process, peak_rss_bytes

HASHER_NAME = "data_prep:hash"
"""The name ps and top show for a hashing process."""
WORKERS_PER_HASHER = 4
"""Tokenizing workers per hashing process: one sha256 without SHA instructions (~0.5 GB/s) keeps
up with about three workers' reading (~0.18 GB/s each), with SHA instructions with about ten."""


def hasher_count(workers: int, files: int) -> int:
    """Hashing processes for a run of ``workers`` workers over ``files`` files (at least one)."""
    return max(1, min(files, -(-max(1, workers) // WORKERS_PER_HASHER)))


def share_files(sizes: Dict[str, int], count: int) -> List[List[str]]:
    """``count`` lists of paths whose byte totals are as even as whole files allow (the largest
    file first, each to the least loaded list); no list is empty when there are enough files."""
    loads = [(0, i) for i in range(count)]
    shares: List[List[str]] = [[] for _ in range(count)]
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        load, i = heapq.heappop(loads)
        shares[i].append(path)
        heapq.heappush(loads, (load + sizes[path], i))
    return [share for share in shares if share]


def _hash_files(paths: List[str], conn) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the early warning, too, is the main process's
    name_this_process(HASHER_NAME)
    try:
        digests = {path: file_sha256(path) for path in paths}
        conn.send((digests, peak_rss_bytes()))
    except BaseException as exc:  # e.g. a file removed during the run
        conn.send(WorkerError(f"hashing the inputs failed: {type(exc).__name__}: {exc}"))


class InputHasher:
    """:meth:`start` the hashing of ``paths`` in up to ``processes`` processes (``sizes``: path ->
    bytes, for sharing the files out); :meth:`result` waits for {path: sha256 hex}."""

    def __init__(self, paths: Sequence[str], processes: int = 1, sizes: Dict[str, int] = None) -> None:
        context = multiprocessing.get_context(start_method())
        sizes = sizes or {}
        shares = share_files({path: sizes.get(path, 0) for path in paths}, max(1, processes)) or [[]]
        self._conns, self._theirs, self._processes = [], [], []
        for share in shares:
            mine, theirs = context.Pipe(duplex=False)
            self._conns.append(mine)
            self._theirs.append(theirs)
            self._processes.append(context.Process(target=_hash_files, args=(share, theirs), daemon=True))
        self._started = False
        self.peak_rss: List[int] = []
        """Each hashing process's peak resident memory (bytes), once :meth:`result` returned."""

    @property
    def processes(self) -> int:
        return len(self._processes)

    def start(self) -> "InputHasher":
        for process, theirs in zip(self._processes, self._theirs):
            process.start()
            theirs.close()
        self._started = True
        return self

    def result(self) -> Dict[str, str]:
        digests: Dict[str, str] = {}
        for conn, process in zip(self._conns, self._processes):
            try:
                share = conn.recv()
            except EOFError:
                process.join()
                raise WorkerError(f"a process hashing the inputs died (exit code {process.exitcode}); "
                                  "re-run the same command to resume") from None
            process.join()
            if isinstance(share, BaseException):
                raise share
            digests.update(share[0])
            self.peak_rss.append(share[1])
        return digests

    def stop(self) -> None:
        """End the hashing early (the run failed or had nothing to do)."""
        if self._started:
            for process in self._processes:
                if process.is_alive():
                    process.terminate()
            for process in self._processes:
                process.join()
        for conn in self._conns:
            conn.close()
