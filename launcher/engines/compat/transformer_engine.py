"""Transformer Engine hidden on request (TRAINWRIGHT_DISABLE_TE=1), so that a GPU machine that has
it runs the paths taken where it is not installed, and the one answer to "is it there"."""

from __future__ import annotations

import os
import sys

DISABLE_TE_ENV = "TRAINWRIGHT_DISABLE_TE"
"""Set to 1 to make this process behave as if Transformer Engine were not installed."""


def hide_transformer_engine() -> None:
    """With TRAINWRIGHT_DISABLE_TE=1, make ``import transformer_engine`` fail in this process, so
    a GPU machine that has TE can run (and test) the paths taken where TE is not installed."""
    import importlib.abc

    class _NoTransformerEngine(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "transformer_engine" or name.startswith("transformer_engine."):
                raise ModuleNotFoundError(f"{name} hidden by TRAINWRIGHT_DISABLE_TE=1")
            return None

    if not any(type(f).__name__ == "_NoTransformerEngine" for f in sys.meta_path):
        sys.meta_path.insert(0, _NoTransformerEngine())


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine`` imports here (and is not hidden by TRAINWRIGHT_DISABLE_TE)."""
    if os.environ.get(DISABLE_TE_ENV) == "1":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def without_te() -> bool:
    """The shim applies in a process without Transformer Engine (or with it hidden)."""
    return not transformer_engine_available()
