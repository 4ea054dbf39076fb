"""``dry_run=true`` (data_prep.estimate): the plan and a sample's estimates (tokens, output bytes
against the free space, time) before a long run, and nothing written."""

from __future__ import annotations

import json

import pytest
from tests.helpers.data_prep import load, prepare, stdlib_documents, write_jsonl

from data_prep.cli import compose
from data_prep.estimate import estimate, estimate_rows, sample_points

IDX_FIXED_BYTES = 34 + 8
"""Bytes of a Megatron .idx that do not grow with its documents: the header (magic, version,
dtype, counts) and the leading 0 of the document index."""


def _estimate(*overrides):
    return estimate(compose(list(overrides)))


def test_a_sample_of_the_whole_input_estimates_it_exactly(tmp_path):
    """Four files smaller than a block: the sample is every byte, so the estimates are the run's
    own numbers."""
    docs = stdlib_documents(80, max_chars=6_000)
    for i in range(4):
        write_jsonl(tmp_path / f"{i}.jsonl", docs[i * 20:(i + 1) * 20])
    args = [f"input={tmp_path}/*.jsonl", f"output={tmp_path / 'out'}", "tokenizer.kind=byte",
            "workers=2"]
    found = _estimate(*args)
    assert found.sampled_files == 4 and found.sampled_bytes == found.input_bytes
    prepare(*args)
    manifest = load(tmp_path / "out" / "manifest.json")
    assert found.tokens == manifest["totals"]["tokens"]
    assert found.sampled_documents == manifest["totals"]["documents"] == 80
    written = sum(p.stat().st_size for p in (tmp_path / "out").iterdir() if p.suffix in (".bin", ".idx"))
    assert written - IDX_FIXED_BYTES * manifest["totals"]["shards"] == found.output_bytes
    assert found.one_core_bytes_per_s > 0 and found.seconds > 0


def test_many_files_are_sampled_evenly_and_scaled(tmp_path):
    """40 files with the same bytes-to-tokens ratio: one block at each of 16 points spread over
    the input (16 files), and the estimate scaled to all 40."""
    for i in range(40):
        with open(tmp_path / f"{i:02d}.jsonl", "w", encoding="utf-8") as handle:
            for _ in range(25):
                handle.write(json.dumps({"text": "x" * 200}) + "\n")
    found = _estimate(f"input={tmp_path}", f"output={tmp_path / 'out'}", "tokenizer.kind=byte",
                      "block_bytes=65536")
    assert sample_points(65536) == 16 and found.sampled_files == 16
    assert found.sampled_bytes == 16 * found.input_bytes // 40
    assert found.tokens == 40 * 25 * 201  # 200 bytes and an EOD per document
    rows = dict(estimate_rows(found))
    line = len(json.dumps({"text": "x" * 200})) + 1
    assert rows["tokens (estimate)"] == f"201,000 ({201 / line:.3f} per input byte)"
    assert rows["sample"] == "16 block(s) in 16 file(s), 0.1 MB: 80,400 tokens, 400 documents"


def test_a_dry_run_writes_nothing_and_prints_the_estimates(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", stdlib_documents(30, max_chars=4_000))
    out = tmp_path / "never" / "out"
    proc = prepare(f"input={path}", f"output={out}", "tokenizer.kind=byte", "dry_run=true")
    assert "data_prep dry run: out (nothing was written)" in proc.stdout
    for quantity in ("tokens (estimate)", "output (estimate)", "one core", "time (estimate)"):
        assert quantity in proc.stdout
    assert not (tmp_path / "never").exists() and proc.stderr == ""


@pytest.mark.slow
def test_a_dry_run_warns_when_the_output_will_not_fit(tmp_path, mount_tmpfs):
    path = write_jsonl(tmp_path / "a.jsonl", stdlib_documents(200, offset=500, max_chars=12_000))
    out = mount_tmpfs("1m") / "out"
    proc = prepare(f"input={path}", f"output={out}", "tokenizer.kind=byte", "dry_run=true")
    assert "data_prep: warning: the output needs about" in proc.stderr
    assert f"but {out} has" in proc.stderr and not out.exists()


def test_a_dry_run_still_checks_the_config(tmp_path):
    proc = prepare(f"input={tmp_path / 'missing.jsonl'}", f"output={tmp_path / 'out'}",
                   "dry_run=true", check=False)
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr


def test_one_large_file_is_sampled_along_its_length(tmp_path):
    from data_prep.estimate import _sample_blocks
    from data_prep.plan import make_plan

    path = write_jsonl(tmp_path / "a.jsonl", stdlib_documents(200, offset=500, max_chars=12_000))
    cfg = compose([f"input={path}", f"output={tmp_path / 'out'}", "tokenizer.kind=byte",
                   "block_bytes=16384"])
    starts = [block.start for block in _sample_blocks(make_plan(cfg), cfg)]
    size = path.stat().st_size
    assert len(starts) == 16 and starts == sorted(set(starts))
    assert starts[0] < size / 16 and starts[-1] > size * 14 / 16
