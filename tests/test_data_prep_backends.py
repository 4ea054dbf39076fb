"""gigatoken and each tokenizer's own library produce identical ids on a real corpus."""

from __future__ import annotations

import numpy as np
import pytest
from tests.helpers.data_prep import stdlib_documents, train_hf_tokenizer, train_sentencepiece

from data_prep.config import TokenizerConfig
from data_prep.tokenizer_choice import resolve_tokenizer
from data_prep.tokenizer_spec import gigatoken_encoder, native_encoder


@pytest.fixture(scope="module")
def corpus():
    """About 2 MB of standard-library sources, non-ASCII and special-token-like text included."""
    docs = stdlib_documents(120, offset=150, max_chars=40_000)
    return docs + ["naïve café — 東京 🙂 \u00a0 tabs\tand\r\nCRLF", "x <|endoftext|> y <|fim_prefix|>"]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    return {"hf": str(train_hf_tokenizer(directory)), "sentencepiece": str(train_sentencepiece(directory))}


def _path(kind, files):
    return files.get(kind) or resolve_tokenizer(TokenizerConfig(kind=kind, path="cl100k_base")).path


@pytest.mark.parametrize("kind", ["tiktoken", "hf", "sentencepiece"])
@pytest.mark.parametrize("parallel", [False, True])
def test_gigatoken_matches_native(kind, parallel, corpus, tokenizer_files):
    path = _path(kind, tokenizer_files)
    fast_ids, fast_lengths = gigatoken_encoder(kind, path, parallel=parallel).encode_batch(corpus)
    ids, lengths = native_encoder(kind, path).encode_batch(corpus)
    assert len(ids) > 250_000
    assert np.array_equal(fast_lengths, lengths)
    assert np.array_equal(fast_ids, ids)


def test_auto_backend_picks_gigatoken_with_reason(tokenizer_files):
    for kind in ("tiktoken", "hf", "sentencepiece"):
        info = resolve_tokenizer(TokenizerConfig(kind=kind, path=_path(kind, tokenizer_files)))
        assert info.backend == "gigatoken", info.backend_note
        assert "matches" in info.backend_note


def test_tiktoken_special_text_is_ordinary(corpus):
    """Text spelling <|endoftext|> is not turned into the EOD id by either backend."""
    path = _path("tiktoken", {})
    ids, _ = gigatoken_encoder("tiktoken", path, parallel=False).encode_batch([corpus[-1]])
    assert 100257 not in ids.tolist() and 100258 not in ids.tolist()


def test_native_backend_can_be_forced(tokenizer_files):
    info = resolve_tokenizer(TokenizerConfig(kind="hf", path=tokenizer_files["hf"], backend="native"))
    assert info.backend == "native" and info.eod_id == 0 and info.vocab_size == 1200


def test_probe_verdict_is_cached_per_file_and_versions(tmp_path, monkeypatch):
    from data_prep import tokenizer_spec
    from data_prep.backend_cache import cache_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = resolve_tokenizer(TokenizerConfig(kind="tiktoken", path="cl100k_base"))
    assert "cached" not in first.backend_note and (tmp_path / "trainwright").is_dir()
    tokenizer_spec.native_encoder.cache_clear()
    second = resolve_tokenizer(TokenizerConfig(kind="tiktoken", path="cl100k_base"))
    assert "cached" in second.backend_note and cache_path().startswith(str(tmp_path))
    assert (second.vocab_size, second.eod_id, second.backend) == (first.vocab_size, first.eod_id, first.backend)
    assert tokenizer_spec.native_encoder.cache_info().currsize == 0, "tiktoken itself was not loaded"
