"""The checkpoint directory layout, torch-free: where a run's checkpoints are and which one a
run resumes from.

Under ``<run_dir>/checkpoints``::

    step_000100/          the engine's own files, written by every rank
      trainwright.json    step, consumed samples, resolved config and plan, and the records a
                          resume is checked against (rank 0; :data:`META`)
      rng/rank_<r>.pt     every RNG state of rank r
      complete            written last; a directory without it is never resumed from
    step_000200.tmp/      a save in progress (or the debris of one that crashed)
    latest                pointer file naming the newest complete step directory

:class:`launcher.runtime.checkpoint.CheckpointManager` writes this layout; :func:`find_resume`
reads it, and never starts from scratch silently: an explicitly requested checkpoint that is
missing or incomplete, or a ``latest`` that names nothing usable, raises
:class:`~launcher.core.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from launcher.core.atomic import read_pointer
from launcher.core.errors import CheckpointError

COMPLETE = "complete"
"""Marker file written last into a step directory."""
META = "trainwright.json"
"""The step directory's metadata (step, consumed samples, config, plan, records)."""
LATEST = "latest"
"""Pointer file in the checkpoints directory naming the newest complete step."""
_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Resume:
    """Where training continues from."""

    path: Path
    """The step_<N> directory."""
    step: int
    """Optimizer steps already taken."""
    consumed_samples: int
    """Training samples the run has read so far (where the data order continues)."""
    arriving: Optional[Callable[[], Path]] = field(default=None, compare=False, repr=False)
    """A download from object storage still landing (None: every file is local). Called,
    collectively, before the engine reads: waits for the files and returns the step directory
    (``path`` is, until then, where the download puts them, its metadata already there)."""

    origin: str = field(default="", compare=False)
    """The object-storage step it was downloaded from (``s3://...``); empty when local."""

    @property
    def where(self) -> str:
        """What messages name: the store's step while its download lands, else the path."""
        return self.origin if self.arriving is not None and self.origin else str(self.path)

    def landed(self) -> "Resume":
        """This resume with every file local (collective while :attr:`arriving`)."""
        if self.arriving is None:
            return self
        return replace(self, path=self.arriving(), arriving=None)


def step_name(step: int) -> str:
    """``step_000100``: the directory name of ``step``."""
    return f"step_{step:06d}"


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


def directory_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def read_meta(step_dir: Path) -> dict:
    """The ``trainwright.json`` of a step directory ({} when it cannot be read)."""
    try:
        meta = json.loads((Path(step_dir) / META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def resume_point(step_dir: Path) -> Resume:
    """The :class:`Resume` of a complete step directory; CheckpointError naming what is wrong."""
    if not step_dir.is_dir():
        raise CheckpointError(f"checkpoint {step_dir} does not exist")
    if not (step_dir / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {step_dir} is incomplete or corrupt: "
                              f"{step_dir / COMPLETE} is missing")
    return resume_from_meta(step_dir)


def resume_from_meta(step_dir: Path) -> Resume:
    """The :class:`Resume` that ``step_dir``'s metadata file names (whether or not the rest of
    the step is there yet); CheckpointError when it is unreadable."""
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
        return resume_point(checkpoints_dir / name)
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
        return resume_point(path)
    checkpoints_dir = Path(run_dir) / "checkpoints"
    if (checkpoints_dir / LATEST).exists():
        return _from_pointer(checkpoints_dir)
    if complete_steps(checkpoints_dir):
        raise CheckpointError(f"{checkpoints_dir} holds complete checkpoints but no {LATEST} "
                              f"pointer; set trainer.load to one of them")
    return None
