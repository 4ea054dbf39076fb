"""JSON-lines files read back (metrics.jsonl, events.jsonl): :func:`read_jsonl`."""

from __future__ import annotations

from pathlib import Path


def read_jsonl(path: Path) -> list:
    """The records of a JSON-lines file ([] when it is missing); a line cut by a crash is
    skipped. orjson reads about 3x as fast as json: a 1,000,000-step metrics.jsonl is 435 MB."""
    import orjson

    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    with path.open("rb") as handle:
        for line in handle:
            try:
                rows.append(orjson.loads(line))
            except ValueError:  # orjson.JSONDecodeError is one
                continue
    return rows
