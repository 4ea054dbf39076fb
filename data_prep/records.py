"""Turn raw input bytes into document texts; every record that is not a usable text gets a reason.

Reasons that skip a record and count towards ``max_bad_fraction`` are in :data:`BAD_REASONS`.
``blank_line`` skips without counting as bad; :data:`REPAIRS` are counted but keep the record
(a byte-order mark is removed, a CRLF line ending is read as LF).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Dict, Iterator, List, Optional, Tuple

try:
    from orjson import loads as fast_loads
except ImportError:  # pragma: no cover - orjson is a declared dependency
    fast_loads = json.loads

BOM = b"\xef\xbb\xbf"
BAD_REASONS = ("invalid_json", "truncated_last_line", "non_utf8", "invalid_unicode", "not_an_object",
               "missing_key", "null_text", "non_string_text", "empty_text")
NEUTRAL_REASONS = ("blank_line",)
REPAIRS = ("bom_stripped", "crlf_line_ending")


class RecordSink:
    """Collects accepted texts, reason counts and the first few examples of each reason."""

    def __init__(self, examples_per_reason: int, strict: bool) -> None:
        self.texts: List[str] = []
        self.counts: Counter = Counter()
        self.examples: Dict[str, List[Tuple[int, str]]] = {}
        self.examples_per_reason = examples_per_reason
        self.strict = strict
        self.failure: Optional[Tuple[int, str, str]] = None

    def skip(self, line: int, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        kept = self.examples.setdefault(reason, [])
        if len(kept) < self.examples_per_reason:
            kept.append((line, detail[:160]))
        if self.strict and reason in BAD_REASONS and self.failure is None:
            self.failure = (line, reason, detail[:300])

    def repaired(self, reason: str) -> None:
        self.counts[reason] += 1


def _slow_parse(line: bytes) -> Tuple[object, str, str]:
    """(object, '', '') or (None, reason, detail) for a line the fast parser rejected."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, "non_utf8", f"byte 0x{line[exc.start]:02x} at column {exc.start + 1}"
    try:
        return json.loads(text), "", ""
    except ValueError as exc:
        return None, "invalid_json", str(exc)


def _text_of(obj: object, key: str) -> Tuple[Optional[str], str, str]:
    """(text, '', '') or (None, reason, detail) for a parsed JSON value."""
    if type(obj) is not dict:
        return None, "not_an_object", f"top-level value is {type(obj).__name__}, not an object"
    if key not in obj:
        keys = ", ".join(list(obj)[:8])
        return None, "missing_key", f"no key {key!r} (keys: {keys}); set text_key=<key>"
    text = obj[key]
    if text is None:
        return None, "null_text", f"{key!r} is null"
    if type(text) is not str:
        return None, "non_string_text", f"{key!r} is {type(text).__name__}, not a string"
    if not text:
        return None, "empty_text", f"{key!r} is an empty string"
    return text, "", ""


WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")
"""Bytes that bytes.isspace() accepts: only a line starting with one can be blank."""


def _line_count(data: bytes) -> int:
    """Lines in ``data`` (a final newline ends the last line; no data, no line). Counting costs
    as much as a third of the parsing, so the parsers count only when they stop early."""
    return data.count(b"\n") + (not data.endswith(b"\n") and bool(data))


def _lines(data: bytes, sink: RecordSink) -> Iterator[Tuple[int, memoryview]]:
    """(line number, line) for every line of ``data``, after removing CR line endings and BOMs.
    Lines are views into ``data`` (no copy of the bytes: orjson parses a view directly)."""
    view, size, start, number = memoryview(data), len(data), 0, 0
    while start < size:
        end = data.find(b"\n", start)
        after = end + 1
        if end < 0:
            end = after = size
        number += 1
        if end > start and data[end - 1] == 13:  # b"\r"
            end -= 1
            sink.repaired("crlf_line_ending")
        if data.startswith(BOM, start, end):
            start += 3
            sink.repaired("bom_stripped")
        yield number, view[start:end]
        start = after


def _blank(line: memoryview) -> bool:
    return not line or (line[0] in WHITESPACE and bytes(line).isspace())


def parse_jsonl(data: bytes, key: str, sink: RecordSink, at_file_end: bool) -> int:
    """Append the texts of JSON lines in ``data`` to ``sink``; returns the number of lines."""
    unterminated_last = at_file_end and not data.endswith(b"\n")
    last = _line_count(data) if unterminated_last else 0  # once per file, at its end
    number = 0
    for number, line in _lines(data, sink):
        if _blank(line):
            sink.skip(number, "blank_line", "")
            continue
        slow = False
        try:
            obj = fast_loads(line)
        except ValueError:
            slow = True
            obj, reason, detail = _slow_parse(bytes(line))
            if reason:
                if reason == "invalid_json" and number == last:
                    reason = "truncated_last_line"
                sink.skip(number, reason, detail)
                if sink.failure:
                    return _line_count(data)
                continue
        text, reason, detail = _text_of(obj, key)
        if slow and reason == "" and not _encodable(text):
            reason, detail = "invalid_unicode", "text holds a lone surrogate (\\ud800-\\udfff escape)"
        if reason:
            sink.skip(number, reason, detail)
            if sink.failure:
                return _line_count(data)
            continue
        sink.texts.append(text)
    return number


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def parse_text_lines(data: bytes, sink: RecordSink) -> int:
    """One document per non-empty line; returns the number of lines."""
    number = 0
    for number, line in _lines(data, sink):
        if _blank(line):
            sink.skip(number, "blank_line", "")
            continue
        try:
            sink.texts.append(str(line, "utf-8"))
        except UnicodeDecodeError as exc:
            sink.skip(number, "non_utf8", f"byte 0x{line[exc.start]:02x} at column {exc.start + 1}")
            if sink.failure:
                return _line_count(data)
    return number


def parse_text_file(data: bytes, sink: RecordSink) -> None:
    """The whole of ``data`` is one document (its line number is 1)."""
    if data.startswith(BOM):
        data = data[3:]
        sink.repaired("bom_stripped")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        sink.skip(1, "non_utf8", f"byte 0x{data[exc.start]:02x} at offset {exc.start}")
        return
    if not text:
        sink.skip(1, "empty_text", "file is empty")
        return
    sink.texts.append(text)


def parse_column(values: list, key: str, sink: RecordSink) -> None:
    """Parquet rows (row number = line number) of one column's Python values."""
    for number, value in enumerate(values, start=1):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                sink.skip(number, "non_utf8", f"byte 0x{value[exc.start]:02x} at offset {exc.start}")
                continue
        text, reason, detail = _text_of({key: value}, key)
        if reason:
            sink.skip(number, reason, detail)
            if sink.failure:
                return
            continue
        sink.texts.append(text)
