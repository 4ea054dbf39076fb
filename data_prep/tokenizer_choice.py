"""Pick the tokenizer file, its special ids and the fastest backend that gives the native ids."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np

from data_prep.backend_cache import cache_path, cached_verdict, store_verdict, verdict_key
from data_prep.errors import ConfigError
from data_prep.manifest import file_sha256
from data_prep.tokenizer_spec import (BOS_CANDIDATES, BYTE_BOS, BYTE_EOD, BYTE_VOCAB, EOD_CANDIDATES,
                                      PROBE_TEXTS, TokenizerInfo, _hf_named_token, gigatoken_encoder,
                                      hf_tokenizer_file, native_encoder, tiktoken_rank_file)


def _resolve_file(kind: str, path: str) -> str:
    if kind == "byte":
        return ""
    if not path:
        raise ConfigError(f"tokenizer.kind={kind} needs tokenizer.path=<file>; "
                          "or use tokenizer.kind=byte, which needs no file")
    if kind == "tiktoken":
        return tiktoken_rank_file(path)
    if kind == "hf":
        return hf_tokenizer_file(path)
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer.path={path!r}: no such SentencePiece .model file")
    return os.path.abspath(path)


def _native_special_ids(kind: str, file: str, native) -> Tuple[int, int, int]:
    """(vocab size, EOD id or -1, BOS id or -1) as the tokenizer itself defines them."""
    if kind == "byte":
        return BYTE_VOCAB, BYTE_EOD, BYTE_BOS
    if kind == "tiktoken":
        enc = native.encoding
        eod = enc._special_tokens.get("<|endoftext|>", -1)
        return enc.n_vocab, eod, -1
    if kind == "hf":
        tok = native.tokenizer
        eod_text = _hf_named_token(file, "eos_token", EOD_CANDIDATES)
        bos_text = _hf_named_token(file, "bos_token", BOS_CANDIDATES)
        eod = tok.token_to_id(eod_text) if eod_text else None
        bos = tok.token_to_id(bos_text) if bos_text else None
        return (tok.get_vocab_size(with_added_tokens=True),
                -1 if eod is None else eod, -1 if bos is None else bos)
    sp = native.processor
    return sp.get_piece_size(), sp.eos_id(), sp.bos_id()


def _special_ids(cfg, vocab: int, eod: int, bos: int) -> Tuple[int, int]:
    eod = cfg.eod_token_id if cfg.eod_token_id >= 0 else eod
    bos = cfg.bos_token_id if cfg.bos_token_id >= 0 else bos
    if cfg.append_eod and eod < 0:
        raise ConfigError("this tokenizer defines no end-of-document token; set "
                          "tokenizer.eod_token_id=<id> or tokenizer.append_eod=false")
    if cfg.prepend_bos and bos < 0:
        raise ConfigError("this tokenizer defines no BOS token; set tokenizer.bos_token_id=<id> "
                          "or tokenizer.prepend_bos=false")
    return eod, bos


def _probe_agrees(fast, native) -> bool:
    """Both encoders give the same ids for every probe text (gigatoken's single-text encode
    returns numpy, so the main process never has to import awkward)."""
    native_ids, native_lengths = native.encode_batch(list(PROBE_TEXTS))
    expected = np.split(native_ids, np.cumsum(native_lengths)[:-1])
    return all(np.array_equal(fast.tokenizer.encode(text), ids) for text, ids in zip(PROBE_TEXTS, expected))


def _choose_backend(kind: str, file: str, wanted: str, native, sha256: str) -> Tuple[str, str]:
    if kind == "byte" or wanted == "native":
        return "native", "byte tokenizer" if kind == "byte" else "backend=native requested"
    try:
        fast = gigatoken_encoder(kind, file, parallel=False)
    except Exception as exc:  # gigatoken refuses some tokenizer types (e.g. unigram models)
        if wanted == "gigatoken":
            raise ConfigError(f"gigatoken cannot load {file}: {exc}; use tokenizer.backend=auto") from None
        return "native", f"gigatoken cannot load it ({type(exc).__name__}: {exc})"
    if wanted == "gigatoken":
        return "gigatoken", "backend=gigatoken requested"
    key = verdict_key(kind, sha256)
    agrees = _probe_agrees(fast, native)
    store_verdict(key, agrees)
    if not agrees:
        return "native", "gigatoken ids differ from the native library on the probe texts"
    return "gigatoken", "gigatoken loads it and matches the native library on the probe texts"


def _from_cached_verdict(cfg, kind: str, file: str, sha256: str) -> Optional[TokenizerInfo]:
    """tiktoken files that gigatoken already matched (same file and versions): the ids, vocabulary
    and special tokens come from gigatoken, and tiktoken's slow rank-file load is skipped."""
    wanted = str(cfg.backend)
    if kind != "tiktoken" or wanted != "auto" or cached_verdict(verdict_key(kind, sha256)) is not True:
        return None
    fast = gigatoken_encoder(kind, file, parallel=False)
    eod = fast.tokenizer._special_tokens().get("<|endoftext|>", -1)
    vocab = fast.tokenizer.vocab_size
    eod, bos = _special_ids(cfg, vocab, eod, -1)
    return TokenizerInfo(kind=kind, path=file, sha256=sha256, vocab_size=max(vocab, eod + 1, bos + 1),
                         eod_id=eod, bos_id=bos, backend="gigatoken",
                         backend_note="gigatoken matches the native library on the probe texts "
                                      f"(verdict cached in {cache_path()})")


def resolve_tokenizer(cfg) -> TokenizerInfo:
    """Resolve ``cfg`` (the ``tokenizer`` section) into a TokenizerInfo; ConfigError when unusable."""
    kind = str(cfg.kind)
    file = _resolve_file(kind, cfg.path)
    sha256 = file_sha256(file) if file else ""
    cached = _from_cached_verdict(cfg, kind, file, sha256)
    if cached is not None:
        return cached
    try:
        native = native_encoder(kind, file)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"cannot load {kind} tokenizer {file}: {type(exc).__name__}: {exc}; "
                          "check tokenizer.kind matches the file") from None
    vocab, eod, bos = _native_special_ids(kind, file, native)
    eod, bos = _special_ids(cfg, vocab, eod, bos)
    backend, note = _choose_backend(kind, file, str(cfg.backend), native, sha256)
    return TokenizerInfo(kind=kind, path=file, sha256=sha256,
                         vocab_size=max(vocab, eod + 1, bos + 1), eod_id=eod, bos_id=bos,
                         backend=backend, backend_note=note)
