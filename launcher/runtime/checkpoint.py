"""Crash-safe checkpoints of any engine plus everything a resume needs: :class:`CheckpointManager`.

Layout under ``<run_dir>/checkpoints``::

    step_000100/          the engine's own files (DeepSpeed's model and ZeRO partitions, or
                          Megatron-Core's megatron/ dist-checkpoint), written by every rank
      trainwright.json    step, consumed samples, resolved config and plan, and the records
                          a resume is checked against: architecture, layout, training
                          (launcher.runtime.resume; rank 0)
      rng/rank_<r>.pt     python, numpy, torch CPU, CUDA and Megatron RNG-tracker states
      complete            written last; a directory without it is never resumed from
    latest                pointer file naming the newest complete step directory

A save writes ``step_<N>.tmp``; after every rank has finished (barrier) rank 0 writes
``complete``, renames the directory to ``step_<N>``, moves ``latest`` (atomic rename) and only then
prunes to ``keep_last``. A crash at any point leaves the previous checkpoint and pointer intact.
A write that fails (a full disk, a full quota, an I/O error) raises :class:`CheckpointError`
naming the directory and its free space (:mod:`launcher.runtime.diskfull`); rank 0 removes the
partial ``step_<N>.tmp``, and stale ``.tmp`` directories are removed before each save.

An async save (engine=megatron, ``trainer.async_save``) returns once the tensor write is scheduled
in a background process; the same completion (barrier, ``complete``, rename, ``latest``, prune)
runs later in :meth:`CheckpointManager.poll` / :meth:`~CheckpointManager.wait`, after every
rank's write has finished: polled at each step by the loop, waited for before the next save and
before the training loop exits (also when the stop step was already saved). Until then the
directory is ``step_<N>.tmp``.

:func:`find_resume` never starts from scratch silently: an explicitly requested checkpoint that is
missing or incomplete, or a ``latest`` that names nothing usable, raises :class:`CheckpointError`
naming the file. A load that fails names every tensor torch or Megatron-Core names (missing and
unexpected keys, both shapes of a mismatch), not just the first line of the error.
"""

from __future__ import annotations

import importlib
import json
import pickle
import random
import re
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from launcher.atomic import atomic_symlink_or_pointer, atomic_write_json, atomic_write_text, \
    read_pointer
from launcher.compose import CONFIG_ERROR_EXIT
from launcher.engines.base import CheckpointError
from launcher.runtime import collectives, diskfull
from launcher.runtime.metrics import NullMetricsLogger

__all__ = ["CheckpointError", "CheckpointManager", "IncompatibleCheckpoint", "Resume",
           "complete_steps", "find_resume", "load", "prune", "read_meta", "step_name",
           "unreadable_files"]

COMPLETE = "complete"
META = "trainwright.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
MAX_ERROR_LINES = 40
"""Lines of a load error kept in the CheckpointError (torch lists one line per tensor)."""


class IncompatibleCheckpoint(CheckpointError):
    """A checkpoint this run must not (or cannot) load as configured: a different architecture,
    engine or a layout the engine cannot convert. A config error: the process exits 2 and the
    message names every difference and the settings that would resume it."""

    exit_code = CONFIG_ERROR_EXIT


@dataclass(frozen=True)
class Resume:
    """Where training continues from."""

    path: Path  # the step_<N> directory
    step: int  # optimizer steps already taken
    consumed_samples: int


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _rng_state() -> dict:
    """Every RNG state of this process, as tensors, numbers and tuples only (so that it loads
    with ``torch.load(weights_only=True)``)."""
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


NUMPY_RNG_GLOBALS = (np.dtype, np.ndarray, type(np.dtype(np.uint32)),
                     importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core")
                                             else "numpy.core.multiarray")._reconstruct)
"""What RNG files written before they held tensors only need beyond weights-only loading (numpy
arrays; ``torch.serialization.get_unsafe_globals_in_checkpoint`` lists them); no code runs."""


def load_rng_file(path: Path) -> dict:
    """An RNG state file, loaded without running code: weights-only, plus numpy arrays (older
    files) allowed by name."""
    with torch.serialization.safe_globals(list(NUMPY_RNG_GLOBALS)):
        return torch.load(path, weights_only=True)


@dataclass(frozen=True)
class _Pending:
    """A save whose tensors are still being written in the background (async save)."""

    tmp: Path
    final: Path
    step: int
    started: float  # time.perf_counter() when the save began
    background: bool = False  # written while training went on (the seconds include steps)


def directory_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _rate(nbytes: int, seconds: float) -> str:
    """``17.0 GB in 12.9 s (1.32 GB/s)``."""
    return f"{nbytes / 1e9:.2f} GB in {seconds:.1f} s ({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s)"


class CheckpointManager:
    """The run's checkpoints: the atomic step-directory protocol around one engine's
    :class:`launcher.engines.base.CheckpointIO` (see the module docstring).

    ``async_save`` lets a save before ``final_step`` write in the background; the manager keeps
    the pending save (at most one: a new save first completes the previous one) and completes it
    in :meth:`poll` (each step) or :meth:`wait`. Every method is collective: all ranks call it at
    the same step, and :attr:`pending` is the same on every rank."""

    def __init__(self, checkpoints_dir: Path, io, *, keep_last: int, async_save: bool = False,
                 final_step: int = 0, record: Optional[dict] = None,
                 report: Optional[Callable] = None):
        self.dir, self.io = Path(checkpoints_dir), io
        # metrics.log_event: one line per save and load (the no-op logger's without one)
        self.report = report or NullMetricsLogger().log_event
        self.keep_last, self.async_save, self.final_step = keep_last, async_save, final_step
        self.record = dict(record or {})  # architecture, layout, training (runtime.resume)
        self._pending: Optional[_Pending] = None

    def warm_up(self) -> None:
        """Let the engine's IO start what its first save needs (after any resume load, which
        it would otherwise compete with for the CPU)."""
        self.io.warm_up()

    @property
    def pending(self) -> bool:
        """Whether a background save is waiting for its writes."""
        return self._pending is not None

    def save(self, step: int, *, consumed_samples: int, config: dict, plan: dict,
             background: bool = True) -> Path:
        """Save ``step``; in the background when allowed (``background``, ``async_save`` and not
        the last step), else complete on return. Returns the final step directory. A failed
        write raises :class:`CheckpointError` (see :meth:`_write`)."""
        self.wait()
        final = self.dir / step_name(step)
        tmp = self.dir / (final.name + ".tmp")
        if collectives.rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob("step_*.tmp"):  # debris of an earlier crash or full disk
                shutil.rmtree(stale, ignore_errors=True)
        collectives.barrier()
        background = background and self.async_save and step < self.final_step
        meta = {"step": step, "consumed_samples": consumed_samples, "config": config,
                "plan": plan, **self.record}
        started = time.perf_counter()
        if not background:  # the caller waits for it: say so before the wait, not after
            self.report("checkpoint", f"checkpoint step {step}: saving to {final}", step=step)
        deferred = self._write(tmp, step, meta, background)
        self._pending = _Pending(tmp, final, step, started, deferred)
        if not deferred:
            self._complete()
        return final

    def _write(self, tmp: Path, step: int, meta: dict, background: bool) -> bool:
        """This rank's files of ``tmp``: the engine's, its RNG states, and (rank 0) the metadata.
        A write that fails raises CheckpointError naming ``tmp``, its free space and whether
        the disk is full; rank 0 removes the partial directory (``latest`` is untouched)."""
        rank = collectives.rank()
        try:
            deferred = self.io.write(tmp, background=background)
            (tmp / "rng").mkdir(parents=True, exist_ok=True)
            torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
            if rank == 0:
                atomic_write_json(tmp / META, meta)
            return deferred
        except (OSError, RuntimeError) as exc:
            if not diskfull.is_write_failure(exc):
                raise
            error = diskfull.write_error(exc, tmp, step=step, latest=read_pointer(
                self.dir / LATEST))
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from exc

    def poll(self) -> Optional[Path]:
        """Complete the pending save if every rank's write has finished (no wait); its path."""
        return self._finish(blocking=False)

    def wait(self) -> Optional[Path]:
        """Wait for the pending save, if any, and complete it; its path."""
        return self._finish(blocking=True)

    def _finish(self, blocking: bool) -> Optional[Path]:
        if self._pending is None or not self.io.finish_background(blocking):
            return None
        return self._complete()

    def _complete(self) -> Path:
        """After every rank has written the pending ``tmp``: ``complete``, rename, ``latest``,
        prune. Only here does a checkpoint get its final name."""
        pending, self._pending = self._pending, None
        collectives.barrier()
        if collectives.rank() == 0:
            atomic_write_text(pending.tmp / COMPLETE, f"{pending.step}\n")
            if pending.final.exists():
                shutil.rmtree(pending.final)
            pending.tmp.rename(pending.final)
            atomic_symlink_or_pointer(self.dir / LATEST, pending.final.name)
            seconds = time.perf_counter() - pending.started
            nbytes = directory_bytes(pending.final)
            how = " in the background" if pending.background else ""
            self.report("checkpoint", f"checkpoint step {pending.step} saved{how}: "
                        f"{_rate(nbytes, seconds)}", step=pending.step, bytes=nbytes,
                        seconds=round(seconds, 3))
            prune(self.dir, self.keep_last)
        collectives.barrier()
        return pending.final

    def load(self, resume: "Resume") -> None:
        """Restore the engine state and this rank's RNG streams from ``resume`` (collective).
        A file that cannot be read raises :class:`CheckpointError` naming it."""
        started = time.perf_counter()
        load(self.io, resume)
        collectives.barrier()
        if collectives.rank() == 0:
            seconds, nbytes = time.perf_counter() - started, directory_bytes(resume.path)
            self.report("checkpoint", f"checkpoint step {resume.step} loaded: "
                        f"{_rate(nbytes, seconds)}", step=resume.step, bytes=nbytes,
                        seconds=round(seconds, 3))


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


def read_meta(step_dir: Path) -> dict:
    """The ``trainwright.json`` of a step directory ({} when it cannot be read)."""
    try:
        meta = json.loads((Path(step_dir) / META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


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


def error_text(exc: BaseException, max_lines: int = MAX_ERROR_LINES) -> str:
    """Every line of ``exc``'s message (torch names one tensor per line: missing and unexpected
    keys, each size mismatch with both shapes), up to ``max_lines``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n  ".join(lines)


_MISMATCH = re.compile(r"size mismatch|shape mismatch|missing key|unexpected key|"
                       r"not found in|missing_keys|unexpected_keys", re.IGNORECASE)


def _load_error(resume: Resume, exc: BaseException) -> CheckpointError:
    bad = unreadable_files(resume.path)
    text = error_text(exc)
    where = (f"corrupt or truncated file(s): {', '.join(map(str, bad))}" if bad
             else f"no truncated file found under {resume.path}")
    hint = ""
    if not bad and _MISMATCH.search(text):
        hint = (f"; the checkpoint's tensors do not fit this model: compare the model settings "
                f"in {resume.path / META} (config.model) with this run's, and resume with "
                "those values or start a new run.name")
    return CheckpointError(f"cannot load checkpoint {resume.path}: {type(exc).__name__}:\n  "
                           f"{text}\n{where}{hint}")


def load(io, resume: Resume) -> None:
    """Restore engine state (weights, optimizer, ZeRO partitions) through the engine's checkpoint
    ``io`` and this rank's RNG streams. A shard that cannot be read raises
    :class:`CheckpointError` naming the file."""
    try:
        io.read(resume.path)
    except CheckpointError:
        raise  # the engine's own diagnosis (e.g. an unconvertible layout): keep its message
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as exc:
        raise _load_error(resume, exc) from exc
    rng_file = resume.path / "rng" / f"rank_{collectives.rank()}.pt"
    if not rng_file.is_file():
        raise CheckpointError(f"{rng_file} is missing (saved with a different world size?)")
    try:
        state = load_rng_file(rng_file)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise _load_error(resume, exc) from exc
    _set_rng_state(state)
