"""The tokenizer the tasks' text is encoded with: :func:`eval_tokenizer_path` finds it (the
run's own unless ``eval.tokenizer`` names one), :class:`TextTokenizer` encodes with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from launcher.config import DataConfig, EvalConfig


def eval_tokenizer_path(ev: EvalConfig, data: DataConfig) -> Optional[str]:
    """``eval.tokenizer``, else ``data.tokenizer_path``, else the Hugging Face tokenizer named by
    the manifest beside the first data prefix (written by data_prep); None when none is given."""
    for candidate in (ev.tokenizer, data.tokenizer_path):
        if candidate:
            return candidate
    for prefix in data.prefixes[:1]:
        manifest = Path(prefix).parent / "manifest.json"
        if manifest.is_file():
            tok = json.loads(manifest.read_text()).get("tokenizer") or {}
            if tok.get("kind") == "hf" and tok.get("path"):
                return tok["path"]
    return None


class TextTokenizer:
    """A Hugging Face ``tokenizer.json`` (the tokenizers library): text to ids, no special
    tokens added."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self._tok = Tokenizer.from_file(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out (as lm-evaluation-harness's Hugging Face
        backend decodes a generation)."""
        return self._tok.decode(ids, skip_special_tokens=True)

