"""The body of a worker process: blocks come in on a pipe, part descriptions go out.

The main process sends ``("init", info, settings)`` once, then ``(block, skip)`` for every block
it gives this worker, place orders for the parts it reported (:mod:`data_prep.held_parts`), and
``None`` to stop. For each part the worker sends ``("part", PartResult)`` with the ids' count and
CRC-32, never the ids; it writes them into the shard when told where (``("placed", path)``). An
exception is sent as ``("error", block index, exception)``.
"""

from __future__ import annotations

import gc
import pickle
import resource
import signal
import traceback

from data_prep.crc import crc32
from data_prep.errors import WorkerError


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (bytes): VmHWM, the high-water mark of its current
    address space. ``ru_maxrss`` is not used where /proc has VmHWM: Linux carries it over
    ``exec``, so a ``python -m data_prep`` started by a large process (a test runner, a notebook)
    reported that process's peak as its own."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


WORKER_NAME = "data_prep:work"
"""The name ps, top and psutil show for a worker process (Linux; 15 bytes at most)."""
PR_SET_NAME = 15
"""prctl(2) option that names the calling thread (the process, for a one-thread process)."""


def name_this_process(name: str) -> None:
    """Show ``name`` for this process in ps and top (its command line is the main process's
    when it was forked); no-op where prctl is missing."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (AttributeError, OSError):
        pass


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a WorkerError holding its traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return WorkerError(f"a worker failed: {type(exc).__name__}: {exc}\n{text}")


def _run_block(conn, block, skip: int, held) -> None:
    from data_prep.worker import block_parts, parse_part, tokenize_into

    for number, part, last in block_parts(block, skip):
        result, texts = parse_part(block, number, part, last)
        tokenize_into(result, texts)
        tokens, result.tokens = result.tokens, None
        result.crc32 = crc32(memoryview(tokens).cast("B"))
        if len(tokens):
            held.keep(result.index, result.part, tokens)
        result.peak_rss = peak_rss_bytes()
        conn.send(("part", result))
        held.serve_pending(conn)


def worker_main(conn) -> None:
    """Entry point of a worker process (Ctrl-C is the main process's to handle; SIGTERM ends a
    forked worker as it ends a spawned one, not through the main process's handler)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the early warning, too, is the main process's
    name_this_process(WORKER_NAME)
    from data_prep.held_parts import HeldParts
    from data_prep.worker import init_worker, warm_up

    warm_up()
    gc.freeze()  # the imports made no garbage: later collections, and the one at exit, skip them
    held, index = HeldParts(), -1
    try:
        while (message := held.next_message(conn)) is not None:
            if message[0] == "init":
                init_worker(message[1], message[2])
                continue
            block, skip = message
            index = block.index
            _run_block(conn, block, skip, held)
    except (EOFError, BrokenPipeError):
        return  # the main process is gone
    except BaseException as exc:
        try:
            conn.send(("error", index, _sendable(exc)))
        except (OSError, ValueError):
            pass
