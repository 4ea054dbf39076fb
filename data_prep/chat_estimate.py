"""``python -m data_prep format=chat dry_run=true``: what a chat run would write, from a sample.

The first ``SAMPLE`` conversations are rendered, masked and packed on one core exactly as the run
would (nothing is written); their tokens per input byte (uncompressed JSONL) or per row (Parquet,
whose row counts the files' footers give) scale to every input: conversations, tokens, trained tokens,
rows, packing efficiency, output bytes against the output filesystem's free space, and the time
at the sample's speed per worker.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import time

from data_prep.chat_prep import (ChatTally, ChatTask, chat_files, check_settings, packed_length,
                                 row_capacity, take_result)
from data_prep.chat_records import init_worker, read_records, render_chunk
from data_prep.packing import best_fit_decreasing

SAMPLE = 2000


def input_units(files) -> tuple[int, int]:
    """(JSONL bytes, Parquet rows) of every input."""
    import pyarrow.parquet as pq

    jsonl = sum(f.size for f in files if f.format == "jsonl" and not f.compression)
    rows = sum(pq.ParquetFile(f.path).metadata.num_rows for f in files if f.format == "parquet")
    return jsonl, rows


def sample(cfg, files) -> tuple[ChatTally, list, int, float]:
    """(tally, kept lengths, JSONL bytes read, seconds) of the first SAMPLE records."""
    init_worker(cfg.tokenizer.path, cfg.chat.template, str(cfg.chat.mask))
    tally, lengths, read_bytes = ChatTally(), [], 0
    start = time.perf_counter()
    records = list(itertools.islice(read_records(files), SAMPLE))
    for result in render_chunk(records):
        kept = take_result(result, cfg, row_capacity(cfg), tally)
        if kept is not None:
            lengths.append(len(kept.ids))
    return tally, lengths, jsonl_bytes_read(files, records), time.perf_counter() - start


def jsonl_bytes_read(files, records: list) -> int:
    """Bytes of the JSONL lines the sampled ``records`` came from (through their last line)."""
    last: dict = {}
    for path, line, _, _ in records:
        last[path] = line
    total = 0
    for f in files:
        if f.format != "jsonl" or f.compression or f.path not in last:
            continue
        with open(f.path, "rb") as handle:  # only the sampled lines are read
            total += sum(len(handle.readline()) for _ in range(last[f.path]))
    return total


def chat_dry_run(cfg) -> int:
    """Print the estimate (module docstring); 0."""
    check_settings(cfg)
    task = ChatTask.of(cfg, os.path.abspath(cfg.output))
    files = chat_files(cfg, task)
    tally, lengths, read_bytes, seconds = sample(cfg, files)
    jsonl_bytes, parquet_rows = input_units(files)
    scale = (jsonl_bytes / read_bytes if read_bytes else 0.0) + (
        parquet_rows / tally.records if tally.records and parquet_rows else 0.0)
    scale = max(scale, 1.0)
    packing = best_fit_decreasing([packed_length(n, cfg.chat.pack_multiple) for n in lengths],
                                  row_capacity(cfg)) if lengths and cfg.chat.pack else None
    row_count = len(packing.rows) if packing else len(lengths)  # trained: seq_length + 1 each
    efficiency = sum(lengths) / (row_count * (cfg.seq_length + 1)) if lengths else 0.0
    tokens = tally.tokens * scale
    workers = cfg.workers or os.cpu_count() or 1
    out = os.path.abspath(cfg.output)
    free = shutil.disk_usage(out if os.path.isdir(out) else os.path.dirname(out) or ".").free
    out_bytes = tokens / max(efficiency, 1e-9) * 3  # uint16 ids + uint8 mask per row token
    rows = [("inputs", f"{len(files)} file(s)" + (
        f" (array task {task.task_index + 1} of {task.num_tasks})" if task.num_tasks > 1 else "")),
            ("sample", f"{tally.records:,} conversations in {seconds:.1f} s"),
            ("conversations (estimate)", f"{tally.samples * scale:,.0f}"),
            ("tokens", f"{tokens:,.0f} ({tally.target_tokens * scale:,.0f} trained)"),
            ("packing efficiency", f"{efficiency:.2%} of rows of {cfg.seq_length + 1:,}"),
            ("skipped / truncated / too long", f"{sum(tally.counts.values())} / "
             f"{tally.truncated} / {tally.dropped_long} in the sample"),
            ("output", f"about {out_bytes / 1e9:,.2f} GB ({free / 1e9:,.0f} GB free)"),
            ("time", f"about {seconds * scale / workers / 60:,.1f} min on {workers} worker(s)")]
    print(f"data_prep dry run (format=chat, nothing was written): {out}")
    for name, value in rows:
        print(f"  {name:32s} {value}")
    compressed = [f.path for f in files if f.compression]
    if compressed:
        print(f"data_prep: note: {len(compressed)} compressed input(s) are not scaled (their "
              "size before compression is unknown until read): the estimate leaves them out "
              "beyond the sample", file=sys.stderr)
    if out_bytes > free:
        print(f"data_prep: warning: the output needs about {out_bytes / 1e9:,.1f} GB and "
              f"{free / 1e9:,.1f} GB are free", file=sys.stderr)
    return 0
