"""Remember which tokenizer files gigatoken was checked against (probe verdicts), so a later run
with the same file and library versions need not load the native library just to re-check.

The cache is ``$XDG_CACHE_HOME/trainwright/data_prep_backends.json`` (``~/.cache/...``); a
missing, unreadable or unwritable cache only means the check runs again.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from typing import Optional

from data_prep.tokenizer_spec import PROBE_TEXTS

NATIVE_PACKAGES = {"tiktoken": "tiktoken", "hf": "tokenizers", "sentencepiece": "sentencepiece"}


def cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "trainwright", "data_prep_backends.json")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def verdict_key(kind: str, sha256: str) -> str:
    probe = hashlib.sha256("\0".join(PROBE_TEXTS).encode("utf-8")).hexdigest()[:16]
    return f"{kind}:{sha256}:gigatoken={_version('gigatoken')}:" \
           f"{NATIVE_PACKAGES[kind]}={_version(NATIVE_PACKAGES[kind])}:probe={probe}"


def _load() -> dict:
    try:
        with open(cache_path(), encoding="utf-8") as handle:
            data = json.load(handle)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_verdict(key: str) -> Optional[bool]:
    value = _load().get(key)
    return value if isinstance(value, bool) else None


def store_verdict(key: str, agrees: bool) -> None:
    data = _load()
    data[key] = agrees
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
