"""A worker's token ids between tokenizing and writing: held in memory until the main process says
where in which shard they go, then written there by the worker itself.

The main process decides shard boundaries and byte offsets in part order, from the token counts
the workers report; it then sends the worker that holds a part ``("place", block index, part,
path, offset)``, and the worker writes the ids at that offset of the shard's temporary file
(``os.pwrite``) and answers ``("placed", path)``. So every id is written once, by the process
that made it, and the main process copies none (at 64+ cores, copying every id through one
process would make that process the limit).

A worker stops taking new work while it holds more than ``HELD_LIMIT_BYTES`` and serves place
orders until it is under the limit again, so memory stays bounded even when a slow block ahead of
its own keeps its parts from being placed. This cannot deadlock: the earliest part not yet placed
belongs to a worker that is still computing it (a worker only waits after sending its parts).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Dict, Optional, Tuple

import numpy as np

HELD_LIMIT_BYTES = 256 * 1024 * 1024
"""A worker holding more ids than this (bytes) waits for place orders before its next part."""


class HeldParts:
    """The parts a worker has reported and not yet written, and messages that arrived meanwhile."""

    def __init__(self, limit: Optional[int] = None) -> None:
        self.limit = HELD_LIMIT_BYTES if limit is None else limit
        self.parts: Dict[Tuple[int, int], np.ndarray] = {}
        self.bytes = 0
        self.inbox: deque = deque()
        """Messages other than place orders that arrived while serving (handled in order later)."""
        self._fd, self._path = -1, ""

    def keep(self, index: int, part: int, tokens: np.ndarray) -> None:
        self.parts[(index, part)] = tokens
        self.bytes += tokens.nbytes

    def next_message(self, conn):
        """The next message that is not a place order (place orders met on the way are served)."""
        while True:
            message = self.inbox.popleft() if self.inbox else conn.recv()
            if not self._serve(conn, message):
                return message

    def serve_pending(self, conn) -> None:
        """Serve the place orders that have arrived; wait for more while over the limit."""
        while conn.poll(0) or (self.bytes > self.limit and self.parts):
            message = conn.recv()
            if not self._serve(conn, message):
                self.inbox.append(message)

    def _serve(self, conn, message) -> bool:
        if not (isinstance(message, tuple) and message and message[0] == "place"):
            return False
        _, index, part, path, offset = message
        tokens = self.parts.pop((index, part))
        self.bytes -= tokens.nbytes
        self._write(path, offset, memoryview(tokens).cast("B"))
        conn.send(("placed", path))
        return True

    def _write(self, path: str, offset: int, data: memoryview) -> None:
        if path != self._path:  # a new shard: the previous one is committed (and renamed)
            self.close()
            self._fd, self._path = os.open(path, os.O_WRONLY), path
        while data:
            written = os.pwrite(self._fd, data, offset)
            data, offset = data[written:], offset + written

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._path = -1, ""
