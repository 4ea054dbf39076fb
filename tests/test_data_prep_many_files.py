"""Costs per input file stay small (a task of a terabyte run can hold millions of files): one stat
per file when listing, a read buffer no larger than the file, a manifest written by orjson, and
an output that does not depend on how the documents are spread over files."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import PurePath

import numpy as np
import pytest
from tests.helpers.data_prep import prepare, read_documents, stdlib_documents, write_jsonl

from data_prep.cli import compose
from data_prep.inputs import detect_format, suffixes
from data_prep.manifest import _chunks, file_crc32, file_sha256, load_manifest, write_manifest
from data_prep.plan import fingerprint, make_plan


@pytest.mark.parametrize("name", ["a.jsonl", "/x/y/a.jsonl.zst", ".hidden", ".hidden.txt", "a.",
                                  "a..b", "noext", "/d.d/file", "a.tar.gz", "..a.b", "a.b."])
def test_suffixes_are_pathlibs(name):
    assert suffixes(name) == PurePath(name).suffixes


def test_formats_from_suffixes():
    assert detect_format("/d/a.JSONL.ZST", "auto") == ("jsonl", "zst")
    assert detect_format("/d.jsonl/readme", "auto") == ("text", "")
    assert detect_format("/d/x.parquet", "auto") == ("parquet", "")


@pytest.mark.parametrize("size", [0, 10, 5 * 2**20])
def test_reading_a_file_allocates_no_more_than_it_holds(tmp_path, size):
    """Zeroing a 4 MiB buffer for every small file cost 20 times the hashing of a 2 KB one."""
    import hashlib
    import zlib

    path = tmp_path / "f"
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    chunks = list(_chunks(str(path)))
    assert all(len(chunk.obj) <= size + 1 for chunk in chunks)
    assert file_sha256(str(path)) == hashlib.sha256(data).hexdigest()
    assert file_crc32(str(path)) == zlib.crc32(data)


def test_the_fingerprint_keeps_the_mtime_the_inputs_were_listed_with(tmp_path):
    """A file changed during the run: its re-run must see the change, so the manifests the run
    writes may not take the new mtime."""
    path = write_jsonl(tmp_path / "a.jsonl", ["one document"])
    cfg = compose([f"input={path}", f"output={tmp_path / 'out'}", "tokenizer.kind=byte"])
    listed = os.stat(path).st_mtime_ns
    later = listed + 10**9

    def changed_meanwhile(files, workers):
        os.utime(path, ns=(later, later))

    plan = make_plan(cfg, on_inputs=changed_meanwhile)
    assert fingerprint(plan, cfg)["inputs"] == [[str(path), path.stat().st_size, listed]]


def test_the_manifest_is_indented_utf8_json(tmp_path):
    manifest = {"inputs": [{"path": "/data/é.jsonl", "size": 3}], "skipped": Counter(blank=2),
                "wall_time_s": 0.125, "complete": False}
    path = tmp_path / "manifest.json"
    write_manifest(str(path), manifest)
    text = path.read_text(encoding="utf-8")
    assert text.startswith('{\n  "inputs": [\n    {\n      "path": "/data/é.jsonl"')
    assert text.endswith("}\n") and json.loads(text) == manifest == load_manifest(str(path))


@pytest.mark.slow
def test_one_document_per_file_gives_the_documents_of_one_jsonl(tmp_path):
    """A directory of .txt files (text_unit=file) and a JSONL of the same texts, in the same
    order: the same token ids, document by document."""
    docs = stdlib_documents(60, max_chars=4_000)
    for index, text in enumerate(docs):
        sub = tmp_path / "files" / f"{index // 25:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{index:04d}.txt").write_text(text, encoding="utf-8")
    write_jsonl(tmp_path / "one.jsonl", docs)
    common = ["tokenizer.kind=byte", "workers=2", "block_bytes=16384", "name=c"]
    prepare(f"input={tmp_path / 'files'}", f"output={tmp_path / 'a'}", *common)
    prepare(f"input={tmp_path / 'one.jsonl'}", f"output={tmp_path / 'b'}", *common)
    many, one = read_documents(tmp_path / "a"), read_documents(tmp_path / "b")
    assert len(many) == len(one) == len(docs)
    assert all(np.array_equal(x, y) for x, y in zip(many, one))
