"""Checkpoint files are read without running code.

Checkpoint files are pickles (torch's zip archives, torch DCP's ``.metadata``), and a pickle can
name any callable to run while it loads: a run directory on a filesystem others can write to
would run their code in every job that resumes, generates or exports from it. So every file of
a checkpoint trainwright reads is unpickled here:

* torch archives load with ``torch.load(weights_only=True)`` plus exactly the classes DeepSpeed
  stores beside its tensors (:data:`ALLOWED`, found with
  ``torch.serialization.get_unsafe_globals_in_checkpoint`` on checkpoints of every engine
  setting: ZeRO 0-3, offload, TP, bf16/fp32; Megatron-Core's need none);
* torch DCP's ``.metadata`` pickle loads with :class:`MetadataUnpickler`, which knows only the
  metadata classes DCP writes (:data:`METADATA_CLASSES`);
* while an engine reads a checkpoint, :func:`launcher.engines.compat.checkpoint_loads_without_code`
  routes the libraries' own loads (DeepSpeed's ``torch.load(weights_only=False)``, DCP's
  ``pickle.load`` and its byte items) through them.

A file that needs anything else is refused: :class:`UnsafeCheckpointFile` names the file and
what it asked for (a config error: exit 2, nothing is loaded).
"""

from __future__ import annotations

import functools
import importlib
import pickle
import sys
import zipfile
from pathlib import Path
from typing import IO, Any, Union

import numpy as np
import torch

from launcher.core.errors import IncompatibleCheckpoint

ALLOWED = (
    # DeepSpeed 0.19's ZeRO optimizer states (bf16 and fp16 training, every stage)
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    # numpy arrays of the RNG files written before they held tensors only
    "numpy.dtype", "numpy.ndarray", "numpy.dtypes.UInt32DType",
    ("numpy._core.multiarray._reconstruct" if hasattr(np, "_core")
     else "numpy.core.multiarray._reconstruct"),
)
"""What checkpoint archives may hold beyond tensors, numbers, strings and containers."""


@functools.cache
def _allowed(with_deepspeed: bool) -> tuple:
    out = []
    for path in ALLOWED:
        module, name = path.rsplit(".", 1)
        if with_deepspeed or module.split(".")[0] != "deepspeed":
            out.append(getattr(importlib.import_module(module), name))
    return tuple(out)


def allowed_globals(with_deepspeed: bool = False) -> list:
    """The objects :data:`ALLOWED` names. DeepSpeed's only when asked or when this process has
    imported DeepSpeed already: its import takes seconds (0.65 s of a Megatron-Core rank's
    2.9 s read of gpt2_124m's state), and Megatron-Core's checkpoints hold none of its
    classes; :func:`load` imports it and tries again when an archive names one."""
    return list(_allowed(with_deepspeed or "deepspeed" in sys.modules))


def _names_deepspeed(exc: BaseException) -> bool:
    """Whether a weights-only refusal is of a DeepSpeed class :data:`ALLOWED` lists."""
    text = str(exc)
    return any(path in text for path in ALLOWED if path.startswith("deepspeed."))

METADATA_CLASSES = {
    "torch": {"Size", "bfloat16", "float16", "float32", "float64", "int64", "int32", "int8",
              "uint8", "bool"},
    "torch.serialization": {"_get_layout"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType",
                                             "TensorWriteData"},
}
"""module -> names torch DCP (torch 2.13) writes into a checkpoint's ``.metadata``."""


class UnsafeCheckpointFile(IncompatibleCheckpoint):
    """A checkpoint file that cannot be read without running code it names."""


def _where(source: Union[str, Path, IO[bytes]]) -> str:
    return str(source) if isinstance(source, (str, Path)) else getattr(source, "name", "a stream")


REFUSED: list = []
"""The refusals of this process, newest last (a library may wrap the error it raised into its
own: :func:`launcher.engines.compat.checkpoint_loads_without_code` finds it here)."""


def refuse(source: Union[str, Path, IO[bytes]], reason: str) -> UnsafeCheckpointFile:
    """The error for ``source``, which asked for ``reason`` while loading (also recorded in
    :data:`REFUSED`)."""
    error = UnsafeCheckpointFile(
        f"refused to load checkpoint file {_where(source)}: it needs {reason}, which is not "
        "among what DeepSpeed and Megatron-Core store (launcher/engines/unpickle.py); loading "
        "it could run code. Nothing was loaded. Use a checkpoint written by trainwright, or "
        "remove the file if it is not yours")
    REFUSED.append(error)
    return error


def load(source: Union[str, Path, IO[bytes]], *args: Any, **kwargs: Any) -> Any:
    """``torch.load`` of a checkpoint archive, weights only plus :data:`ALLOWED` (whatever
    ``weights_only`` the caller passes); :class:`UnsafeCheckpointFile` for anything else."""
    kwargs["weights_only"] = True
    if not _is_archive(source):
        raise refuse(source, "to be read as a bare pickle (it is not a torch.save archive)")
    start = None if isinstance(source, (str, Path)) else source.tell()
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.serialization.load(source, *args, **kwargs)
    except pickle.UnpicklingError as exc:
        if "deepspeed" in sys.modules or not _names_deepspeed(exc):
            raise refuse(source, _first_line(exc)) from None
    if start is not None:
        source.seek(start)
    with torch.serialization.safe_globals(allowed_globals(with_deepspeed=True)):
        try:
            return torch.serialization.load(source, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            raise refuse(source, _first_line(exc)) from None


def _is_archive(source: Union[str, Path, IO[bytes]]) -> bool:
    """Whether a file is a zip archive, as torch.save has written since torch 1.6, or the start
    of one (a truncated archive: torch.load reports it, and the load error names the file). Its
    older format is a bare pickle stream, which nothing trainwright reads was written in. A
    stream (DCP's views into its files) is left to torch.load, weights only."""
    if not isinstance(source, (str, Path)) or zipfile.is_zipfile(source):
        return True
    with open(source, "rb") as handle:
        return handle.read(4) == b"PK\x03\x04"


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if "GLOBAL" in line or "global" in line]
    return (lines[-1] if lines else str(exc).splitlines()[0]).strip()


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP's ``.metadata``: its classes (:data:`METADATA_CLASSES`) only."""

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise refuse(self._source, f"the global {module}.{name}")

    def __init__(self, file: IO[bytes]):
        super().__init__(file)
        self._source = file


def load_metadata(file: IO[bytes]) -> Any:
    """``pickle.load`` of a DCP ``.metadata`` file through :class:`MetadataUnpickler`."""
    return MetadataUnpickler(file).load()
