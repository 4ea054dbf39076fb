"""Checkpoints named by ``s3://`` on a command line (``checkpoint=`` of convert, generate and
evaluate; ``trainer.init_from``): the committed step is downloaded once per node, by the
launching process before any rank starts, into a local cache, and the command goes on with the
local copy (every reader of a step directory then works unchanged).

The cache is ``$TRAINWRIGHT_CACHE/checkpoints/<bucket>/<prefix>/step_<N>`` (default
``~/.cache/trainwright``); a copy whose commit record matches the store's is used as it is,
anything else is downloaded again (:func:`launcher.runtime.checkpoint_store.fetch`). An
unusable store, a URI with nothing committed or a missing or truncated object exits 2 naming
the key and the URI (never a credential).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Sequence

from launcher.core import objectstore, remote_checkpoints
from launcher.core.errors import CheckpointError
from launcher.core.exits import CONFIG_ERROR_EXIT

CACHE_ENV = "TRAINWRIGHT_CACHE"
"""Root of trainwright's local caches (default ``~/.cache/trainwright``)."""
RETRY_S = 120.0
"""Seconds a download keeps retrying transient failures."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trainwright")


def cache_of(step_uri: objectstore.ObjectURI) -> Path:
    """The local checkpoints folder that caches the store's step folder ``step_uri``."""
    return cache_root() / "checkpoints" / step_uri.bucket / step_uri.prefix.rpartition("/")[0]


def local_checkpoint(value: str, key: str) -> str:
    """``value`` itself when it is a local path; for ``s3://...`` (a committed step folder or a
    checkpoints prefix: its newest commit) the path of its local copy. Exit 2 naming ``key``
    when it cannot be had."""
    if not objectstore.is_remote(value):
        return value
    try:
        uri = objectstore.ObjectURI.parse(value)
        objectstore.check_usable(uri, write=False)
        commit = remote_checkpoints.resolve(uri, time.monotonic() + RETRY_S)
        if commit is None:
            raise CheckpointError(f"nothing is committed under {uri} (no step_<N>/complete)")
        started = time.perf_counter()
        from launcher.runtime.checkpoint_store import fetch  # torch: only when there is one

        path = fetch(commit, cache_of(commit.uri), RETRY_S)
    except (CheckpointError, ValueError) as exc:
        print(f"config error: {key}={value}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    seconds = time.perf_counter() - started
    print(f"[store] {key}={value}: step {commit.step} ({commit.bytes / 1e9:.2f} GB) at {path} "
          f"({seconds:.1f} s)", file=sys.stderr, flush=True)
    return str(path)


def localized(argv: Sequence[str], keys: Sequence[str]) -> list[str]:
    """``argv`` with each ``key=s3://...`` (for ``key`` in ``keys``) pointing at its local
    copy."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in keys and objectstore.is_remote(value):
            arg = f"{key}={local_checkpoint(value, key.lstrip('+~'))}"
        out.append(arg)
    return out
