"""Compressed inputs are checked whole: a truncated or damaged .zst/.gz is an error naming the file.

Before: a .jsonl.zst cut in half was accepted (exit 0, ``complete: true``, about half of its
documents and one ``truncated_last_line`` skip); a cut .gz failed with an EOFError that named no
file. Now either exits 3 naming the file and what is wrong, and no manifest says ``complete``.
"""

from __future__ import annotations

import gzip
import io

import pytest
import zstandard
from tests.helpers.data_prep import load, prepare, stdlib_documents, write_jsonl

from data_prep.cli import compose
from data_prep.decompress import ZstdReader
from data_prep.errors import CorruptInputError
from data_prep.run import execute

ARGS = ["tokenizer.kind=byte", "workers=1", "block_bytes=16384", "shard_tokens=100000"]
DOCS = stdlib_documents(80, offset=200, max_chars=8000)
"""About 600 kB: several zstd blocks of 128 KiB, so shards are committed before the damage."""


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _corrupted(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 16]) + data[middle + 16:]


CASES = [("zst", _truncated, "truncated zstd frame"), ("gz", _truncated, "truncated gzip stream"),
         ("zst", _corrupted, "corrupt zstd data"), ("gz", _corrupted, "corrupt gzip data")]


@pytest.mark.parametrize("suffix,damage,what", CASES, ids=[f"{c[0]}-{c[1].__name__[1:]}" for c in CASES])
def test_a_damaged_compressed_input_fails_naming_the_file(tmp_path, suffix, damage, what):
    path = write_jsonl(tmp_path / f"docs.jsonl.{suffix}", DOCS)
    path.write_bytes(damage(path.read_bytes()))
    out = tmp_path / "out"
    proc = prepare(f"input={path}", f"output={out}", *ARGS, check=False)
    assert proc.returncode == 3, proc.stderr
    assert f"data_prep: error: {path}: {what}" in proc.stderr
    manifest = out / "manifest.json"
    assert not manifest.exists() or not load(manifest)["complete"]
    assert not (out / "data.yaml").exists()
    if damage is _truncated:  # the shards before the damage were committed, as a resumable run
        assert load(manifest)["shards"]


def test_damage_is_found_in_whole_file_documents_too(tmp_path):
    """Plain-text files (one document each) are decompressed by the worker, not the reader."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(DOCS[0].encode()))
    (tmp_path / "in" / "b.txt.zst").write_bytes(_truncated(zstandard.ZstdCompressor().compress(DOCS[1].encode())))
    cfg = compose([f"input={tmp_path / 'in'}", f"output={tmp_path / 'out'}", "progress=false", *ARGS])
    with pytest.raises(CorruptInputError, match=f"{tmp_path / 'in' / 'b.txt.zst'}: truncated zstd frame"):
        execute(cfg)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_concatenated_zstd_frames_and_gzip_members_are_read_whole(tmp_path):
    lines = [f'{{"text": "document {i}"}}\n'.encode() for i in range(300)]
    compress = zstandard.ZstdCompressor(write_checksum=True).compress
    (tmp_path / "a.jsonl.zst").write_bytes(b"".join(compress(b"".join(lines[i:i + 70])) for i in range(0, 300, 70)))
    (tmp_path / "b.jsonl.gz").write_bytes(b"".join(gzip.compress(b"".join(lines[i:i + 70])) for i in range(0, 300, 70)))
    (tmp_path / "c.jsonl.zst").write_bytes(b"")  # an empty file reads as empty, as gzip reads one
    cfg = compose([f"input=[{tmp_path / 'a.jsonl.zst'},{tmp_path / 'b.jsonl.gz'},{tmp_path / 'c.jsonl.zst'}]",
                   f"output={tmp_path / 'out'}", "progress=false", *ARGS, "block_bytes=1024"])
    assert execute(cfg)["totals"]["documents"] == 600


def test_zstd_reader_returns_what_was_asked_across_frames():
    data = b"".join(f"line {i}\n".encode() for i in range(20_000))
    compress = zstandard.ZstdCompressor().compress
    reader = ZstdReader(io.BytesIO(compress(data[:70_000]) + compress(data[70_000:])), "x.zst")
    parts = [reader.read(4097) for _ in range(len(data) // 4097)]
    assert all(len(p) == 4097 for p in parts)
    parts.append(reader.read())
    assert b"".join(parts) == data and reader.read(10) == b""
