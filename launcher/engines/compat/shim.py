"""What every patch of a library internal is (:class:`Shim`), and the conditions and helpers
several of them share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch


@dataclass(frozen=True)
class Shim:
    """One patch of a library internal."""

    name: str
    library: str
    version: str  # the version it was written for (tests compare it with the installed one)
    when: Callable[[], bool]  # applies in this process (e.g. no CUDA); None = applied by caller
    apply: Optional[Callable[[], None]]
    needed: Callable[[], bool]  # the unpatched library still has what the shim works around
    why: str


def cpu_only() -> bool:
    """The shim applies in a process that sees no CUDA device."""
    return not torch.cuda.is_available()


def applied_by_caller() -> bool:
    """Never installed process-wide: its caller applies it where it is needed (the shim's
    ``why`` names the function and where it is called)."""
    return False


@contextlib.contextmanager
def compile_as_identity() -> Iterator[None]:
    """While inside, ``torch.compile`` (as a decorator or a call) returns what it is given."""
    compile_ = torch.compile

    def identity(model=None, **_):
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        yield
    finally:
        torch.compile = compile_
