"""The inspect and train_tokenizer commands, run as a user runs them."""

from __future__ import annotations

import pytest

from tests.helpers.data_prep import load, prepare, run_module, stdlib_documents, write_jsonl


@pytest.mark.slow
def test_inspect_shows_totals_histogram_and_decoded_documents(tmp_path):
    docs = stdlib_documents(12, max_chars=2000)
    write_jsonl(tmp_path / "a.jsonl", docs)
    prepare(f"input={tmp_path / 'a.jsonl'}", f"output={tmp_path / 'out'}", "tokenizer.kind=tiktoken",
            "tokenizer.path=cl100k_base", "workers=1")
    tokens = load(tmp_path / "out" / "manifest.json")["totals"]["tokens"]
    proc = run_module("data_prep.inspect", str(tmp_path / "out"), "--first", "2", "--random", "1",
                      "--max-chars", "100000", check=True)
    assert f"12 documents, {tokens:,} tokens, 1 shard(s), dtype int32, EOD 100257" in proc.stdout
    assert "length histogram" in proc.stdout and "#" in proc.stdout
    assert docs[0] in proc.stdout and docs[1] in proc.stdout
    assert proc.stdout.count("--- random document") == 1


def test_train_tokenizer_builds_a_bpe_of_the_requested_size(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_documents(30, offset=60))
    proc = run_module("data_prep.train_tokenizer", "--input", str(tmp_path / "a.jsonl"), "--vocab-size", "700",
                      "--output", str(tmp_path / "tok"), check=False)
    assert proc.returncode == 0, proc.stderr
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "tok"))
    assert tokenizer.get_vocab_size() == 700 and tokenizer.token_to_id("<|endoftext|>") == 0
    text = "def main():\n    return 'naïve — 東京'\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    too_small = run_module("data_prep.train_tokenizer", "--input", str(tmp_path / "a.jsonl"), "--vocab-size",
                           "100", "--output", str(tmp_path / "t2"))
    assert too_small.returncode == 2 and "at least 257" in too_small.stderr


def test_small_shards_are_warned_about_for_the_split():
    from data_prep.progress import small_shard_warnings

    manifest = {"shards": [{"prefix": "c_00000", "documents": 50}, {"prefix": "c_00001", "documents": 400}]}
    warnings = small_shard_warnings(manifest, "98,1,1")
    assert len(warnings) == 1 and "c_00000" in warnings[0] and "1 shard(s)" in warnings[0]
    assert small_shard_warnings(manifest, "100,0,0") == []


def test_cl100k_preset_and_single_input_compose():
    from data_prep.cli import compose

    cfg = compose(["data_prep=cl100k", "input=/data/*.jsonl", "output=/tmp/x"])
    assert cfg.tokenizer.kind.value == "tiktoken" and cfg.tokenizer.path == "cl100k_base"
    assert list(cfg.input) == ["/data/*.jsonl"] and cfg.workers == 0


def test_inspect_verifies_every_shard_against_the_manifest_crc(tmp_path, monkeypatch, capsys):
    write_jsonl(tmp_path / "a.jsonl", stdlib_documents(20, max_chars=3000))
    out = tmp_path / "out"
    prepare(f"input={tmp_path / 'a.jsonl'}", f"output={out}", "tokenizer.kind=byte", "workers=1",
            "block_bytes=4096", "shard_tokens=15000")
    shards = load(out / "manifest.json")["shards"]
    assert len(shards) >= 3
    intact = run_module("data_prep.inspect", str(out), "--verify-only")
    assert intact.returncode == 0, intact.stderr
    assert f"verified {len(shards)} shard(s): sizes and CRC-32 match the manifest: OK" in intact.stdout
    damaged = out / f"{shards[1]['prefix']}.bin"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: same size, different CRC-32
    damaged.write_bytes(bytes(data))
    proc = run_module("data_prep.inspect", str(out))  # the plain command verifies first
    assert proc.returncode == 3, proc.stderr
    assert f"damaged shard {damaged}: CRC-32" in proc.stderr
    assert f"1 of {len(shards)} shard(s) do not match the manifest" in proc.stderr
    assert shards[0]["prefix"] not in proc.stderr and "OK" not in proc.stdout

    from data_prep import inspect

    shown = []
    monkeypatch.setattr(inspect, "report", lambda *args: shown.append(args[0]))
    assert inspect.main([str(out), "--no-verify"]) == 0 and shown == [str(out)]
    assert inspect.main([str(out), "--verify-only"]) == 3 and shown == [str(out)]
    assert f"damaged shard {damaged}" in capsys.readouterr().err
