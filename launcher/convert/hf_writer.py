"""Write a Hugging Face model directory tensor by tensor.

The shard layout (``model-0000N-of-0000M.safetensors`` + ``model.safetensors.index.json``) is
planned from tensor shapes before any data is read, so tensors can stream in: a shard is
written (temp file, fsync, rename) as soon as its last tensor arrives and then dropped. Peak
memory is one shard plus the tensor being converted. Everything goes to ``<out>.partial`` and
is renamed to ``<out>`` only when complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

from launcher.core.atomic import atomic_write_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


class ShardedWriter:
    """Collects tensors and writes each planned shard once it is complete."""

    def __init__(self, out: Path, shards: list[list[str]]):
        self.out = Path(out)
        self.shards = shards
        count = len(shards)
        self.files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.where = {name: i for i, names in enumerate(shards) for name in names}
        self.pending: dict[int, dict] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        shard = self.where[name]
        self.pending.setdefault(shard, {})[name] = tensor.contiguous().clone()
        if len(self.pending[shard]) == len(self.shards[shard]):
            self._write(shard, self.pending.pop(shard))

    def _write(self, shard: int, tensors: dict) -> None:
        from safetensors.torch import save_file

        final = self.out / self.files[shard]
        tmp = final.with_name(final.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        self.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def finish(self) -> None:
        if self.pending:
            missing = [n for i in self.pending for n in self.shards[i]
                       if n not in self.pending[i]]
            raise RuntimeError(f"tensors never produced: {', '.join(missing[:8])}")
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {name: self.files[i] for name, i in self.where.items()}}
        atomic_write_json(self.out / "model.safetensors.index.json", index)


def staging_dir(out: Path) -> Path:
    """``<out>.partial``, emptied; refuses an existing non-empty ``out``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"out={out} exists and is not empty; choose a new directory "
                              "(nothing is overwritten)")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish(partial: Path, out: Path) -> None:
    """Rename the finished ``<out>.partial`` to ``out``."""
    out = Path(out)
    if out.exists():
        out.rmdir()  # empty (checked by staging_dir)
    os.replace(partial, out)
