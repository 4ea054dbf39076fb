"""wandb's offline run files read back: the protobuf records of a ``.wandb`` file
(``wandb_records``) and the history rows they hold (``wandb_history``).

Formerly in tests/test_train_secrets.py (tests/test_eval_jobs.py imported it from there) and,
as a copy, in tests/test_runtime_metrics.py. Named ``wandb_runs`` rather than ``wandb`` so that
it never shadows the wandb package.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (a leveldb-style log: 32 KiB blocks of
    checksum/length/type-framed chunks after a 7-byte ``:W&B`` header; types full=1 first=2
    middle=3 last=4)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start, MIDDLE/LAST extend
        if kind in (1, 4) and buf:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def wandb_history(run_file: Path) -> list:
    """The history rows (one dict per logged step) of an offline run file."""
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
