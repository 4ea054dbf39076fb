"""Crash-safe checkpoints of any engine plus everything a resume needs: :class:`CheckpointManager`.

The directory layout (``step_<N>/``, ``complete``, ``latest``, ``trainwright.json``) and the
choice of the checkpoint a run resumes from are :mod:`launcher.core.checkpoints`'s. A save writes
``step_<N>.tmp``; after every rank has finished (barrier) rank 0 writes ``complete``, renames the
directory to ``step_<N>``, moves ``latest`` (atomic rename) and only then prunes to
``keep_last``. A crash at any point leaves the previous checkpoint and pointer intact. A write
that fails (a full disk, a full quota, an I/O error) raises
:class:`~launcher.core.errors.CheckpointError` naming the directory and its free space
(:mod:`launcher.core.diskspace`); rank 0 removes the partial ``step_<N>.tmp``, and stale ``.tmp``
directories are removed before each save.

An async save (engine=megatron, ``trainer.async_save``) returns once the tensor write is scheduled
in a background process; the same completion (barrier, ``complete``, rename, ``latest``, prune)
runs later in :meth:`CheckpointManager.poll` / :meth:`~CheckpointManager.wait`, after every
rank's write has finished: polled at each step by the loop, waited for before the next save and
before the training loop exits (also when the stop step was already saved). Until then the
directory is ``step_<N>.tmp``.

A load that fails names every tensor torch or Megatron-Core names (missing and unexpected keys,
both shapes of a mismatch), not just the first line of the error.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import re
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from launcher.core import diskspace
from launcher.core.atomic import (atomic_symlink_or_pointer, atomic_write_json, atomic_write_text,
                                  read_pointer)
from launcher.core.checkpoints import (COMPLETE, LATEST, META, Resume, directory_bytes, prune,
                                       step_name)
from launcher.core.errors import CheckpointError
from launcher.core.exits import STORAGE_EXIT
from launcher.engines import unpickle
from launcher.parallel import collectives
from launcher.runtime.checkpoint_store import StoreUploads, keep_local
from launcher.runtime.metrics import NullMetricsLogger

MAX_ERROR_LINES = 40
"""Lines of a load error kept in the CheckpointError (torch lists one line per tensor)."""


class SavesFailing(CheckpointError):
    """``trainer.checkpoint_failures_allowed`` saves in a row did not commit (exit 4, never
    restarted: :data:`launcher.core.exits.STORAGE_EXIT`)."""

    exit_code = STORAGE_EXIT


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


def load_rng_file(path: Path) -> dict:
    """An RNG state file, loaded without running code (:mod:`launcher.engines.unpickle`)."""
    return unpickle.load(path)


@dataclass
class _Pending:
    """A save not complete yet: its tensors still being written in the background (async save)
    or, with an object store, its files still being uploaded."""

    tmp: Path
    final: Path
    step: int
    started: float  # time.perf_counter() when the save began
    background: bool = False  # written while training went on (the seconds include steps)
    upload_background: bool = False  # its upload may go on while training does
    uploading: bool = False  # every rank's write finished; the upload started


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
                 report: Optional[Callable] = None,
                 on_complete: Optional[Callable[..., None]] = None,
                 store: Optional[StoreUploads] = None, failures_allowed: int = 0):
        self.dir, self.io = Path(checkpoints_dir), io
        self.store = store
        """Object storage the checkpoints go to (None: ``checkpoints_dir`` is where they are;
        else it stages saves and keeps the newest as a cache)."""
        self.failures_allowed, self.failures = failures_allowed, 0
        # metrics.log_event: one line per save and load (the no-op logger's without one)
        self.report = report or NullMetricsLogger().log_event
        self.keep_last, self.async_save, self.final_step = keep_last, async_save, final_step
        self.record = dict(record or {})  # architecture, layout, training (runtime.resume)
        self._pending: Optional[_Pending] = None
        self.on_complete = on_complete
        """Rank 0, once a checkpoint has its final name and ``latest``, before keep-k prunes:
        (step directory, step), and with a store its s3:// step folder too (e.g.
        :meth:`launcher.runtime.eval_jobs.EvalJobs.saved`)."""

    @property
    def pending(self) -> bool:
        """Whether a background save is waiting for its writes."""
        return self._pending is not None

    def save(self, step: int, *, consumed_samples: int, config: dict, plan: dict,
             background: bool = True, files: Optional[dict] = None) -> Path:
        """Save ``step``; in the background when allowed (``background``, ``async_save`` and not
        the last step), else complete on return. ``files``: name inside the step directory ->
        a file rank 0 copies there (e.g. the tokenizer from_hf keeps). Returns the final step
        directory. A failed write raises :class:`CheckpointError` (see :meth:`_write`)."""
        self.wait()
        final = self.dir / step_name(step)
        tmp = self.dir / (final.name + ".tmp")
        if collectives.rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob("step_*.tmp"):  # debris of an earlier crash or full disk
                shutil.rmtree(stale, ignore_errors=True)
        if self.store is not None:
            self.store.clear_step(step)
        collectives.barrier()
        upload_background = background and step < self.final_step
        background = background and self.async_save and step < self.final_step
        meta = {"step": step, "consumed_samples": consumed_samples, "config": config,
                "plan": plan, **self.record}
        started = time.perf_counter()
        if not background:  # the caller waits for it: say so before the wait, not after
            self.report("checkpoint", f"checkpoint step {step}: saving to {final}", step=step)
        deferred = self._write(tmp, step, meta, background, files or {})
        self._pending = _Pending(tmp, final, step, started, deferred, upload_background)
        if not deferred:
            self._finish(blocking=not upload_background)
        return final

    def _write(self, tmp: Path, step: int, meta: dict, background: bool,
               files: dict) -> bool:
        """This rank's files of ``tmp``: the engine's, its RNG states, and (rank 0) ``files``
        and the metadata. A write that fails raises CheckpointError (:meth:`_write_failures`)."""
        rank = collectives.rank()
        with self._write_failures(tmp, step), self._uploads_as_written(tmp, step, background):
            deferred = self.io.write(tmp, background=background)
            (tmp / "rng").mkdir(parents=True, exist_ok=True)
            torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
            if rank == 0:
                for name, source in files.items():
                    (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, tmp / name)
                atomic_write_json(tmp / META, meta)
            return deferred

    @contextlib.contextmanager
    def _uploads_as_written(self, tmp: Path, step: int, background: bool) -> Iterator[None]:
        """With a store: upload the step's files as they are closed (from before the write; a
        background write forks its writer first, so from after the fork); a failed write ends
        the watch."""
        if self.store is not None and not background:
            self.store.watch(tmp, step)
        try:
            yield
        except BaseException:
            if self.store is not None:
                self.store.abandon()
            raise
        if self.store is not None and background:
            self.store.watch(tmp, step)

    @contextlib.contextmanager
    def _write_failures(self, tmp: Path, step: int) -> Iterator[None]:
        """A write failure inside (an OSError, torch's zip writer) becomes a CheckpointError
        naming ``tmp``, its free space and whether the disk is full (DiskFull, exit 2); rank 0
        removes the partial directory (``latest`` is untouched)."""
        try:
            yield
        except (OSError, RuntimeError) as exc:
            if not diskspace.is_write_failure(exc):
                raise
            error = diskspace.write_error(exc, tmp, step=step, latest=read_pointer(
                self.dir / LATEST))
            if collectives.rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from exc

    def poll(self) -> Optional[Path]:
        """Complete the pending save if every rank's write has finished (no wait); its path."""
        return self._finish(blocking=False)

    def wait(self) -> Optional[Path]:
        """Wait for the pending save, if any, and complete it; its path."""
        return self._finish(blocking=True)

    def _finish(self, blocking: bool) -> Optional[Path]:
        pending = self._pending
        if pending is None:
            return None
        if not pending.uploading:
            with self._write_failures(pending.tmp, pending.step):
                if not self.io.finish_background(blocking):
                    return None
            if self.store is None:
                return self._complete()
            self.store.begin(pending.tmp, pending.step)
            pending.uploading = True
            blocking = blocking or not pending.upload_background
        if not self.store.finished(blocking):
            return None
        return self._committed()

    def _committed(self) -> Optional[Path]:
        """Every rank's upload has ended: commit (rank 0), keep the staged copy as the local
        cache when it is whole (else remove it), keep-k on the store. A failed save is one line
        (:meth:`_failed`); None then."""
        pending, self._pending = self._pending, None
        done, error = self.store.end(pending.step)
        if done is None:
            shutil.rmtree(pending.tmp, ignore_errors=True)
            return self._failed(pending, error)
        self.failures = 0
        collectives.barrier()
        if collectives.rank() == 0:
            if self.store.shared:
                keep_local(pending.tmp, pending.final, done)
            if self.on_complete is not None:  # the metadata read from rank 0's local copy
                self.on_complete(pending.final if self.store.shared else pending.tmp,
                                 pending.step, str(done.uri))
            if self.store.shared:
                prune(self.dir, 1)
            seconds = time.perf_counter() - pending.started
            how = " in the background" if pending.upload_background else ""
            self.report("checkpoint", f"checkpoint step {pending.step} saved{how} to "
                        f"{done.uri}: {_rate(done.bytes, seconds)}", step=pending.step,
                        bytes=done.bytes, seconds=round(seconds, 3), uri=str(done.uri))
            gone = self.store.prune(self.keep_last)
            if gone:
                self.report("checkpoint", f"checkpoints deleted from {self.store.uri} (keep_last="
                            f"{self.keep_last}): steps {', '.join(map(str, gone))}", echo=False)
        if not self.store.shared:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        collectives.barrier()
        return pending.final if self.store.shared else None

    def _failed(self, pending: _Pending, error: str) -> None:
        """One line for a save that did not commit; the run trains on, unless it was the last
        save (CheckpointError) or ``failures_allowed`` saves failed in a row (StoreFailing)."""
        self.failures += 1
        last = pending.step >= self.final_step or not pending.upload_background
        if collectives.rank() == 0:
            then = "the run ends" if last else "training continues; the next interval saves again"
            self.report("checkpoint", f"checkpoint step {pending.step} NOT saved to "
                        f"{self.store.uri}: {error}; nothing committed (the last committed step "
                        f"stays the resume point); {then}", step=pending.step, failed=True)
        if last:
            raise CheckpointError(f"checkpoint step {pending.step} could not be saved to "
                                  f"{self.store.uri}: {error}")
        if self.failures_allowed and self.failures >= self.failures_allowed:
            raise SavesFailing(f"{self.failures} checkpoints in a row could not be saved to "
                               f"{self.store.uri} (trainer.checkpoint_failures_allowed="
                               f"{self.failures_allowed}); last: {error}. Mend the store, then "
                               "resume: the run continues from its last committed step")
        return None

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
            if self.on_complete is not None:
                self.on_complete(pending.final, pending.step)
            prune(self.dir, self.keep_last)
        collectives.barrier()
        return pending.final

    def load(self, resume: "Resume") -> "Resume":
        """Restore the engine state and this rank's RNG streams from ``resume`` (collective);
        the resume as read (its files all local). A file that cannot be read raises
        :class:`CheckpointError` naming it."""
        started = time.perf_counter()
        resume = load(self.io, resume)
        collectives.barrier()
        if collectives.rank() == 0:
            seconds, nbytes = time.perf_counter() - started, directory_bytes(resume.path)
            self.report("checkpoint", f"checkpoint step {resume.step} loaded: "
                        f"{_rate(nbytes, seconds)}", step=resume.step, bytes=nbytes,
                        seconds=round(seconds, 3))
        return resume


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


def load(io, resume: Resume) -> Resume:
    """Restore engine state (weights, optimizer, ZeRO partitions) through the engine's checkpoint
    ``io`` and this rank's RNG streams; the resume as read. A download still landing
    (``resume.arriving``) is waited for after the engine has prepared what the read fills
    (``io.prepare_read``). A shard that cannot be read raises :class:`CheckpointError` naming
    the file."""
    if resume.arriving is not None:
        io.prepare_read()
        resume = resume.landed()
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
    except CheckpointError:
        raise  # refused: it would run code (launcher.engines.unpickle)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise _load_error(resume, exc) from exc
    _set_rng_state(state)
    return resume
