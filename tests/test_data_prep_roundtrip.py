"""Every input format and tokenizer kind round-trips through Megatron-Core's IndexedDataset."""

from __future__ import annotations

import numpy as np
import pytest
from tests.helpers.data_prep import (load, stdlib_documents, train_hf_tokenizer, train_sentencepiece, write_jsonl,
                                write_parquet)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from data_prep.cli import compose
from data_prep.run import execute
from data_prep.shards import index_bytes
from data_prep.tokenizer_spec import TokenizerInfo, build_encoder


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizers")
    return {"hf": str(train_hf_tokenizer(directory)), "sentencepiece": str(train_sentencepiece(directory)),
            "tiktoken": "cl100k_base", "byte": ""}


def _file_corpus(root):
    """Five files, one per document-per-record format, and the documents in output order."""
    docs = stdlib_documents(25, max_chars=6000)
    write_jsonl(root / "a.jsonl", docs[0:5])
    write_jsonl(root / "b.jsonl.gz", docs[5:10])
    write_jsonl(root / "c.jsonl.zst", docs[10:15])
    write_parquet(root / "d.parquet", docs[15:20], row_group_size=2)
    (root / "e").mkdir()
    for i, doc in enumerate(docs[20:25]):
        (root / "e" / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    specs = [str(root / n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e")]
    return specs, docs


def _line_corpus(root):
    lines = [ln for ln in "\n".join(stdlib_documents(3, offset=40)).splitlines() if ln.strip()][:300]
    (root / "lines.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "lines2.txt.gz").write_bytes(__import__("gzip").compress("\n".join(lines[:50]).encode()))
    return [str(root / "lines.txt"), str(root / "lines2.txt.gz")], lines + lines[:50]


def _prepare(specs, out, kind, path, *extra):
    cfg = compose([f"input=[{','.join(specs)}]", f"output={out}", f"tokenizer.kind={kind}",
                   f"tokenizer.path={path}", "workers=1", "progress=false", "block_bytes=4096", *extra])
    return execute(cfg)


def _decoded(out, manifest):
    encoder = build_encoder(TokenizerInfo(**manifest["tokenizer"]))
    texts = []
    for shard in manifest["shards"]:
        dataset = IndexedDataset(str(out / shard["prefix"]), mmap=True)
        assert dataset.index.dtype == np.dtype(manifest["dtype"])
        for i in range(len(dataset)):
            ids = dataset[i]
            assert int(ids[-1]) == manifest["eod_id"], "every document ends with EOD"
            texts.append(encoder.decode(ids[:-1]))
    return texts


@pytest.mark.parametrize("kind", ["byte", "tiktoken", "hf", "sentencepiece"])
def test_every_format_round_trips(kind, tokenizers_dir, tmp_path):
    specs, docs = _file_corpus(tmp_path)
    manifest = _prepare(specs, tmp_path / "out", kind, tokenizers_dir[kind], "shard_tokens=3000")
    assert manifest["totals"]["documents"] == len(docs) == 25
    assert manifest["totals"]["shards"] > 1
    assert _decoded(tmp_path / "out", manifest) == docs
    expected_dtype = "int32" if kind == "tiktoken" else "uint16"
    assert manifest["dtype"] == expected_dtype


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_text_lines_round_trip(kind, tokenizers_dir, tmp_path):
    specs, lines = _line_corpus(tmp_path)
    manifest = _prepare(specs, tmp_path / "out", kind, tokenizers_dir[kind], "text_unit=line")
    assert _decoded(tmp_path / "out", manifest) == lines


def test_bos_and_custom_eod(tokenizers_dir, tmp_path):
    docs = stdlib_documents(3, max_chars=500)
    write_jsonl(tmp_path / "a.jsonl", docs)
    manifest = _prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", "byte", "",
                        "tokenizer.prepend_bos=true", "tokenizer.eod_token_id=255")
    dataset = IndexedDataset(str(tmp_path / "out" / manifest["shards"][0]["prefix"]))
    for i, doc in enumerate(docs):
        ids = dataset[i]
        assert ids[0] == 257 and ids[-1] == 255
        assert bytes(ids[1:-1].astype(np.uint8)).decode() == doc


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_index_is_byte_identical_to_megatron_builder(dtype, tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=37)
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for n in lengths:
        builder.add_document(np.arange(n) % 1000, [int(n)])
    builder.finalize(str(tmp_path / "ref.idx"))
    assert index_bytes(lengths, dtype) == (tmp_path / "ref.idx").read_bytes()


def test_manifest_fields(tokenizers_dir, tmp_path):
    docs = stdlib_documents(6, max_chars=3000)
    write_jsonl(tmp_path / "a.jsonl", docs)
    manifest = _prepare([str(tmp_path / "a.jsonl")], tmp_path / "out", "tiktoken", "cl100k_base",
                        "shard_tokens=1000")
    on_disk = load(tmp_path / "out" / "manifest.json")
    assert on_disk["complete"] is True and on_disk["totals"] == manifest["totals"]
    tok = on_disk["tokenizer"]
    assert tok["kind"] == "tiktoken" and tok["vocab_size"] == 100277 and len(tok["sha256"]) == 64
    assert tok["path"].endswith("cl100k_base.tiktoken") and on_disk["eod_id"] == 100257
    assert on_disk["inputs"][0]["size"] == (tmp_path / "a.jsonl").stat().st_size
    assert len(on_disk["inputs"][0]["sha256"]) == 64
    assert sum(s["documents"] for s in on_disk["shards"]) == on_disk["totals"]["documents"] == 6
    assert sum(s["tokens"] for s in on_disk["shards"]) == on_disk["totals"]["tokens"]
    for shard in on_disk["shards"]:
        assert (tmp_path / "out" / f"{shard['prefix']}.bin").stat().st_size == shard["tokens"] * 4
    assert on_disk["version"] and on_disk["wall_time_s"] > 0 and on_disk["dtype"] == "int32"


def test_eod_bos_placement_loop_and_vectorized_agree():
    from data_prep.assemble import LOOP_MIN_MEAN_LENGTH, with_specials

    rng = np.random.default_rng(1)
    for lengths in (rng.integers(0, 3, 500), rng.integers(LOOP_MIN_MEAN_LENGTH, 400, 30)):
        flat = rng.integers(0, 60000, int(lengths.sum())).astype(np.uint32)
        ids, new_lengths = with_specials(flat, lengths, np.uint16, eod=65000, bos=65001)
        docs = np.split(ids, np.cumsum(new_lengths)[:-1])
        src = np.split(flat, np.cumsum(lengths)[:-1])
        assert all(d[0] == 65001 and d[-1] == 65000 and np.array_equal(d[1:-1], s) for d, s in zip(docs, src))
