"""Crash-safe checkpoints of a DeepSpeed engine plus everything a resume needs.

Layout under ``<run_dir>/checkpoints``::

    step_000100/          DeepSpeed files (model, ZeRO partitions) written by every rank
      trainwright.json    step, consumed samples, resolved config and plan (rank 0)
      rng/rank_<r>.pt     python, numpy, torch CPU, CUDA and Megatron RNG-tracker states
      complete            written last; a directory without it is never resumed from
    latest                pointer file naming the newest complete step directory

A save writes ``step_<N>.tmp``; after every rank has finished (barrier) rank 0 writes
``complete``, renames the directory to ``step_<N>``, moves ``latest`` (atomic rename) and only then
prunes to ``keep_last``. A crash at any point leaves the previous checkpoint and pointer intact.

An async save (engine=megatron, ``trainer.async_save``) returns once the tensor write is scheduled
in a background process; the same completion (barrier, ``complete``, rename, ``latest``, prune)
runs later in :func:`finish_pending`, after every rank's write has finished: polled at each step
by the engine, waited for before the next save and before the training loop exits (also when
the stop step was already saved). Until then the directory is ``step_<N>.tmp``.

:func:`find_resume` never starts from scratch silently: an explicitly requested checkpoint that is
missing or incomplete, or a ``latest`` that names nothing usable, raises :class:`CheckpointError`
naming the file.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from launcher.atomic import atomic_symlink_or_pointer, atomic_write_json, atomic_write_text, \
    read_pointer

COMPLETE = "complete"
META = "trainwright.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for (or pointed at) cannot be used; the message names it."""


@dataclass(frozen=True)
class Resume:
    """Where training continues from."""

    path: Path  # the step_<N> directory
    step: int  # optimizer steps already taken
    consumed_samples: int


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


@dataclass(frozen=True)
class _Pending:
    """A save whose tensors are still being written in the background (async save)."""

    io: object  # the checkpoint IO object that scheduled the write (has finalize_async)
    tmp: Path
    final: Path
    step: int
    keep_last: int


_PENDING: list = []
"""Deferred saves, oldest first (at most one: a new save first waits for the previous one)."""


def save(ds_engine, checkpoints_dir: Path, *, step: int, consumed_samples: int, config: dict,
         plan: dict, keep_last: int) -> Path:
    """Save a complete checkpoint of ``step`` (collective: every rank calls it).

    An engine whose checkpoint IO ``defers_save(step)`` (engine=megatron with
    trainer.async_save) only schedules the tensor write: the checkpoint stays ``step_<N>.tmp``
    without ``complete`` until :func:`finish_pending` sees every rank's write finished; the
    returned path is where it will then be."""
    finish_pending(blocking=True)
    rank = torch.distributed.get_rank()
    checkpoints_dir = Path(checkpoints_dir)
    final = checkpoints_dir / step_name(step)
    tmp = checkpoints_dir / (final.name + ".tmp")
    if rank == 0:
        checkpoints_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash
    _barrier()
    defers = getattr(ds_engine, "defers_save", None)
    deferred = bool(defers(step)) if callable(defers) else False
    if deferred:
        ds_engine.save_checkpoint_async(str(checkpoints_dir), tag=tmp.name)
    else:
        ds_engine.save_checkpoint(str(checkpoints_dir), tag=tmp.name, save_latest=False)
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        atomic_write_json(tmp / META, {"step": step, "consumed_samples": consumed_samples,
                                       "config": config, "plan": plan})
    pending = _Pending(ds_engine, tmp, final, step, keep_last)
    if deferred:
        _PENDING.append(pending)
    else:
        _complete(pending)
    return final


def has_pending() -> bool:
    """Whether a deferred (async) save is waiting for its writes (same answer on every rank)."""
    return bool(_PENDING)


def finish_pending(blocking: bool = True) -> list[Path]:
    """Complete the deferred saves whose writes have finished on every rank, oldest first
    (collective when any is pending); ``blocking`` waits for them. Returns the completed paths.

    Only here does a deferred checkpoint get ``complete``, its final name and ``latest``."""
    done = []
    while _PENDING:
        pending = _PENDING[0]
        if not pending.io.finalize_async(blocking):
            break
        _PENDING.pop(0)
        _complete(pending)
        done.append(pending.final)
    return done


def _complete(pending: _Pending) -> None:
    """After every rank has written ``pending.tmp``: ``complete``, rename, ``latest``, prune."""
    _barrier()
    if torch.distributed.get_rank() == 0:
        final, tmp = pending.final, pending.tmp
        atomic_write_text(tmp / COMPLETE, f"{pending.step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        atomic_symlink_or_pointer(final.parent / LATEST, final.name)
        prune(final.parent, pending.keep_last)
    _barrier()


def complete_steps(checkpoints_dir: Path) -> list[Path]:
    """Complete ``step_<N>`` directories, oldest first."""
    found = [(int(m.group(1)), p) for p in Path(checkpoints_dir).glob("step_*")
             if (m := _STEP_RE.match(p.name)) and (p / COMPLETE).is_file()]
    return [p for _, p in sorted(found)]


def prune(checkpoints_dir: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` (0 = keep all), and stale
    ``.tmp`` directories."""
    for stale in Path(checkpoints_dir).glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last > 0:
        for old in complete_steps(checkpoints_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def _read_meta(step_dir: Path) -> Resume:
    if not step_dir.is_dir():
        raise CheckpointError(f"checkpoint {step_dir} does not exist")
    if not (step_dir / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {step_dir} is incomplete or corrupt: "
                              f"{step_dir / COMPLETE} is missing")
    try:
        meta = json.loads((step_dir / META).read_text())
        return Resume(step_dir, int(meta["step"]), int(meta["consumed_samples"]))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint metadata {step_dir / META} is unreadable: {exc}") \
            from exc


def _from_pointer(checkpoints_dir: Path) -> Resume:
    pointer = checkpoints_dir / LATEST
    name = read_pointer(pointer)
    if name is None:
        raise CheckpointError(f"{pointer} is empty or corrupt; point it at a complete step_<N> "
                              "directory or delete it")
    try:
        return _read_meta(checkpoints_dir / name)
    except CheckpointError as exc:
        raise CheckpointError(f"{pointer} names {name!r}, which is unusable: {exc}") from exc


def find_resume(run_dir: Path, load: str = "") -> Optional[Resume]:
    """The checkpoint to continue from, or None for a fresh start.

    ``load`` (trainer.load) may name a step directory, a checkpoints directory or a run directory;
    it must resolve to a complete checkpoint. Without it, the run directory's ``latest`` is used
    when present (it must then be valid), else None.
    """
    if load:
        path = Path(load)
        for base in (path, path / "checkpoints"):
            if (base / LATEST).exists():
                return _from_pointer(base)
        return _read_meta(path)
    checkpoints_dir = Path(run_dir) / "checkpoints"
    if (checkpoints_dir / LATEST).exists():
        return _from_pointer(checkpoints_dir)
    if complete_steps(checkpoints_dir):
        raise CheckpointError(f"{checkpoints_dir} holds complete checkpoints but no {LATEST} "
                              f"pointer; set trainer.load to one of them")
    return None


def unreadable_files(step_dir: Path) -> list[Path]:
    """The ``.pt`` files under ``step_dir`` that are not complete torch (zip) archives, e.g.
    truncated by a full disk or a partial copy (cheap: reads only each file's zip directory)."""
    bad = []
    for file in sorted(Path(step_dir).rglob("*.pt")):
        try:
            with zipfile.ZipFile(file):
                pass
        except (OSError, zipfile.BadZipFile):
            bad.append(file)
    return bad


def _load_error(resume: Resume, exc: BaseException) -> CheckpointError:
    bad = unreadable_files(resume.path)
    where = (f"corrupt or truncated file(s): {', '.join(map(str, bad))}" if bad
             else f"no truncated file found under {resume.path}")
    return CheckpointError(f"cannot load checkpoint {resume.path} ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}); {where}")


def load(ds_engine, resume: Resume) -> None:
    """Restore engine state (weights, optimizer, ZeRO partitions) and this rank's RNG streams.

    A shard that cannot be read raises :class:`CheckpointError` naming the file."""
    rank = torch.distributed.get_rank()
    try:
        path, _ = ds_engine.load_checkpoint(str(resume.path.parent), tag=resume.path.name,
                                            load_optimizer_states=True,
                                            load_lr_scheduler_states=False)
    except CheckpointError:
        raise  # the engine's own diagnosis (e.g. an unconvertible layout): keep its message
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as exc:
        raise _load_error(resume, exc) from exc
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {resume.path}")
    rng_file = resume.path / "rng" / f"rank_{rank}.pt"
    if not rng_file.is_file():
        raise CheckpointError(f"{rng_file} is missing (saved with a different world size?)")
    try:
        state = torch.load(rng_file, weights_only=False)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise _load_error(resume, exc) from exc
    _set_rng_state(state)
