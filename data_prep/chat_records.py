"""Conversation records of ``data_prep format=chat``, read and rendered.

:func:`read_records` yields every record of the JSONL and Parquet inputs in order (a line that is
not JSON comes as an error, counted by the caller); :func:`rendered` turns them into token ids
and a loss mask (:class:`launcher.core.chat_render.ChatTokenizer`) in a pool of worker
processes, chunk by chunk, in input order, after skipping those a resumed run has already
written.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from typing import Iterator

CHUNK = 256
"""Records per task handed to a worker."""
_STATE: dict = {}


def read_records(files) -> Iterator[tuple]:
    """(path, line, record or None, error) of every record, in input order."""
    import orjson

    from data_prep.decompress import read_whole

    for f in files:
        if f.format == "parquet":
            import pyarrow.parquet as pq

            for row, record in enumerate(pq.read_table(f.path).to_pylist(), 1):
                yield f.path, row, record, ""
            continue
        for line, raw in enumerate(read_whole(f.path, f.compression).splitlines(), 1):
            if not raw.strip():
                continue
            try:
                yield f.path, line, orjson.loads(raw), ""
            except ValueError as exc:
                yield f.path, line, None, f"not JSON: {exc}"


def init_worker(tokenizer_path: str, template: str, mask: str) -> None:
    """A pool worker's set-up: its tokenizer and mask policy. A forked worker inherits data_prep's
    own SIGTERM handler (which stops the run by raising in the main process); here SIGTERM
    ends the worker at once, and Ctrl-C and the early warning (SIGUSR1) are the main process's
    to handle. With the inherited handler, a pool torn down by SIGTERM could wait forever for a
    worker blocked on the task queue's lock (seen: one run in about 30 hung at exit)."""
    from launcher.core.chat_render import ChatTokenizer, MaskPolicy

    if multiprocessing.parent_process() is not None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    _STATE["tokenizer"] = ChatTokenizer(tokenizer_path, template)
    _STATE["policy"] = MaskPolicy(mask)


def render_chunk(chunk: list) -> list:
    """[(path, line, ids, mask, reason, detail)] for a chunk of read records (in a worker)."""
    from launcher.core.chat_render import ChatError, messages_of

    out = []
    for path, line, record, error in chunk:
        if error:
            out.append((path, line, None, None, "invalid_json", error))
            continue
        try:
            if not isinstance(record, dict):
                raise ChatError("a record must be a JSON object")
            rendered = _STATE["tokenizer"].render(messages_of(record), _STATE["policy"])
        except ChatError as exc:
            out.append((path, line, None, None, "bad_conversation", str(exc)))
            continue
        out.append((path, line, rendered.ids, rendered.mask, "", ""))
    return out


def chunks(items: Iterator, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def rendered(files, cfg, skip: int) -> Iterator[tuple]:
    """Every record after the first ``skip`` rendered, in input order (a pool of ``workers``
    processes; 1 = here)."""
    workers = cfg.workers or os.cpu_count() or 1
    args = (cfg.tokenizer.path, cfg.chat.template, str(cfg.chat.mask))
    records = itertools.islice(read_records(files), skip, None)
    if workers == 1:
        init_worker(*args)
        for chunk in chunks(records, CHUNK):
            yield from render_chunk(chunk)
        return
    pool = multiprocessing.get_context("fork").Pool(workers, init_worker, args)
    try:
        for results in pool.imap(render_chunk, chunks(records, CHUNK), chunksize=2):
            yield from results
        pool.close()  # done: the workers exit on the queue's sentinel, nothing is signalled
    except BaseException:  # an error, a stop, or the consumer gone: end the workers now
        pool.terminate()
        raise
    finally:
        pool.join()
