"""sha256 of every input file (the manifest records them), computed by a process of its own.

The main process starts it as soon as the inputs are known, before it loads the tokenizer: the
hashing (~0.3 CPU s per 500 MB) then runs on a core that would otherwise wait for the main
process's start-up, instead of competing with the tokenizer for the cores later. A process, not a
thread: the worker processes are forked after it starts (data_prep.worker_pool), and a process
that forks should have no other thread of its own.
"""

from __future__ import annotations

import multiprocessing
import signal
from typing import Dict, List

from data_prep.errors import WorkerError
from data_prep.manifest import file_sha256
from data_prep.worker_pool import start_method
from data_prep.worker_process import name_this_process

HASHER_NAME = "data_prep:hash"
"""The name ps and top show for the hashing process."""


def _hash_files(paths: List[str], conn) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    name_this_process(HASHER_NAME)
    try:
        conn.send({path: file_sha256(path) for path in paths})
    except BaseException as exc:  # e.g. a file removed during the run
        conn.send(WorkerError(f"hashing the inputs failed: {type(exc).__name__}: {exc}"))


class InputHasher:
    """:meth:`start` the hashing of ``paths``; :meth:`result` waits for {path: sha256 hex}."""

    def __init__(self, paths: List[str]) -> None:
        context = multiprocessing.get_context(start_method())
        self._conn, theirs = context.Pipe(duplex=False)
        self._process = context.Process(target=_hash_files, args=(paths, theirs), daemon=True)
        self._theirs, self._started = theirs, False

    def start(self) -> "InputHasher":
        self._process.start()
        self._theirs.close()
        self._started = True
        return self

    def result(self) -> Dict[str, str]:
        try:
            digests = self._conn.recv()
        except EOFError:
            self._process.join()
            raise WorkerError(f"the process hashing the inputs died (exit code "
                              f"{self._process.exitcode}); re-run the same command to resume") from None
        self._process.join()
        if isinstance(digests, BaseException):
            raise digests
        return digests

    def stop(self) -> None:
        """End the hashing early (the run failed or had nothing to do)."""
        if self._started:
            if self._process.is_alive():
                self._process.terminate()
            self._process.join()
        self._conn.close()
