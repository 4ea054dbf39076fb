"""Checkpoint reads that run no code: torch 2.13's ``torch.load`` and DCP's metadata unpickling,
whichever library calls them (DeepSpeed 0.19.8 and DCP pass ``weights_only=False``)."""

from __future__ import annotations

import contextlib
import pickle
from typing import Iterator

import torch

from launcher.engines import unpickle
from launcher.engines.compat.shim import Shim, applied_by_caller

_STATE = {"safe_loads": False}
"""Inside :func:`checkpoint_loads_without_code` (it is re-entrant)."""


class _MetadataPickle:
    """torch DCP's ``pickle`` module as :func:`checkpoint_loads_without_code` hands it: ``load``
    is :func:`unpickle.load_metadata`, everything else is pickle's."""

    load = staticmethod(unpickle.load_metadata)

    def __getattr__(self, name: str):
        return getattr(pickle, name)


@contextlib.contextmanager
def checkpoint_loads_without_code() -> Iterator[None]:
    """While inside, every ``torch.load`` of this process loads weights only plus what
    :mod:`launcher.engines.unpickle` allows, whatever its caller asks (DeepSpeed 0.19.8's
    ``TorchCheckpointEngine.load`` and torch 2.13's DCP ``DefaultLoadPlanner.load_bytes`` pass
    ``weights_only=False``), and torch DCP's ``.metadata`` is unpickled by
    :class:`unpickle.MetadataUnpickler` (``FileSystemReader.read_metadata`` calls
    ``pickle.load``). Wrap every read of a checkpoint in it; re-entrant. A refusal that the
    library wrapped into an error of its own (DCP collects every rank's exceptions into a
    ``CheckpointException``) leaves as the refusal itself, so the command exits 2 naming it."""
    from torch.distributed.checkpoint import filesystem

    if _STATE.get("safe_loads"):
        yield
        return
    saved, refused = (torch.load, filesystem.pickle), len(unpickle.REFUSED)
    torch.load, filesystem.pickle = unpickle.load, _MetadataPickle()
    _STATE["safe_loads"] = True
    try:
        yield
    except unpickle.UnsafeCheckpointFile:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if len(unpickle.REFUSED) > refused and not isinstance(exc, (KeyboardInterrupt,
                                                                    SystemExit)):
            raise unpickle.REFUSED[-1] from exc
        raise
    finally:
        torch.load, filesystem.pickle = saved
        _STATE["safe_loads"] = False


def _probe_deepspeed_unsafe_load() -> bool:
    """DeepSpeed still loads its checkpoint files with ``weights_only=False``."""
    import inspect

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return "weights_only=False" in inspect.getsource(TorchCheckpointEngine.load)


def _probe_dcp_unsafe_load() -> bool:
    """torch DCP still unpickles ``.metadata`` with ``pickle.load`` and byte items with
    ``weights_only=False``."""
    import inspect

    from torch.distributed.checkpoint import default_planner, filesystem

    return "pickle.load(" in inspect.getsource(filesystem.FileSystemReader.read_metadata) and \
        "weights_only=False" in inspect.getsource(default_planner.DefaultLoadPlanner.load_bytes)


SHIMS = (
    Shim("checkpoint loads without code (DeepSpeed)", "deepspeed", "0.19.8", applied_by_caller,
         None, _probe_deepspeed_unsafe_load, "checkpoint_loads_without_code, around every "
         "checkpoint read: TorchCheckpointEngine.load unpickles with weights_only=False"),
    Shim("checkpoint loads without code (torch DCP)", "torch", "2.13.0", applied_by_caller,
         None, _probe_dcp_unsafe_load, "checkpoint_loads_without_code, around every "
         "checkpoint read: FileSystemReader.read_metadata calls pickle.load, "
         "DefaultLoadPlanner.load_bytes torch.load(weights_only=False)"),
)
