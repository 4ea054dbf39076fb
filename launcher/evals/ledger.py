"""A run's checkpoint evaluations (``eval.asynchronous``): the files under ``<run_dir>/evals/``.

::

    step_000100.request.json   the training's rank 0, when checkpoint step 100 completes:
                               step, tokens trained, the step directory
    step_000100.json           the eval job, once, atomically: the request plus {"tasks": {task:
                               {metric: value}}, "seconds"}
    step_000100.skipped.json   the eval job: the checkpoint was gone (keep-k) before its turn
    step_000100.merged         whoever holds the run's lock, after the scores went into
                               metrics.jsonl, wandb and TensorBoard
    worker.lock                flock of the one eval job that scores requests at a time

Each file has one writer, so no two processes ever rewrite the same file: a request is scored
once (the worker lock, and a result is never recomputed), merged once (the run lock, the marker,
and :func:`merged_in_metrics` for a merge cut off before its marker), and never skipped
silently (a request outlives its checkpoint). Torch-free: the launcher, the ranks and the eval
jobs all read it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Iterator, Optional

from launcher.core.atomic import atomic_write_json, atomic_write_text

EVALS_DIR = "evals"
_REQUEST = re.compile(r"^step_(\d+)\.request\.json$")
ASYNC_KEY = "eval/checkpoint_step"
"""Key of a merged result's metrics.jsonl line: the checkpoint step it scored."""


def evals_dir(run_dir: Path) -> Path:
    return Path(run_dir) / EVALS_DIR


def _path(run_dir: Path, step: int, suffix: str) -> Path:
    return evals_dir(run_dir) / f"step_{step:06d}{suffix}"


def request(run_dir: Path, *, step: int, tokens: int, checkpoint: Path) -> bool:
    """Ask for checkpoint ``step`` to be scored; False when it was asked for already."""
    path = _path(run_dir, step, ".request.json")
    if path.exists():
        return False
    evals_dir(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"step": step, "tokens": tokens, "checkpoint": str(checkpoint)})
    return True


def _read(path: Path) -> Optional[dict]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def requests(run_dir: Path) -> list[dict]:
    """Every request, oldest step first (an unreadable one is skipped: it is rewritten by the
    training's next look at its checkpoints)."""
    found = []
    for path in evals_dir(run_dir).glob("step_*.request.json"):
        if _REQUEST.match(path.name) and (record := _read(path)) is not None:
            found.append(record)
    return sorted(found, key=lambda r: r["step"])


def settled(run_dir: Path, step: int) -> bool:
    """Whether ``step`` was scored or skipped."""
    return _path(run_dir, step, ".json").exists() or _path(run_dir, step, ".skipped.json").exists()


def pending(run_dir: Path) -> list[dict]:
    """The requests neither scored nor skipped, oldest first."""
    return [r for r in requests(run_dir) if not settled(run_dir, r["step"])]


def write_result(run_dir: Path, record: dict) -> Path:
    """The scores of one request (its fields plus ``tasks`` and ``seconds``), atomically."""
    path = _path(run_dir, record["step"], ".json")
    atomic_write_json(path, record)
    return path


def write_skip(run_dir: Path, record: dict, reason: str) -> None:
    atomic_write_json(_path(run_dir, record["step"], ".skipped.json"), {**record, "reason": reason})


def result(run_dir: Path, step: int) -> Optional[dict]:
    return _read(_path(run_dir, step, ".json"))


def unmerged(run_dir: Path) -> list[dict]:
    """Scores not yet in the run's metrics, oldest step first."""
    found = []
    for record in requests(run_dir):
        step = record["step"]
        if not _path(run_dir, step, ".merged").exists() and (done := result(run_dir, step)):
            found.append(done)
    return found


def mark_merged(run_dir: Path, step: int) -> None:
    atomic_write_text(_path(run_dir, step, ".merged"), f"{step}\n")


def merged_in_metrics(run_dir: Path) -> set[int]:
    """Checkpoint steps whose scores are in ``metrics.jsonl`` already (a merge cut off between
    its line and its marker must not be merged again)."""
    steps = set()
    try:
        with open(Path(run_dir) / "metrics.jsonl", "rb") as handle:
            for line in handle:
                if ASYNC_KEY.encode() in line:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        steps.add(int(json.loads(line)[ASYNC_KEY]))
    except OSError:
        pass
    return steps


@contextlib.contextmanager
def worker_lock(run_dir: Path) -> Iterator[bool]:
    """Hold ``evals/worker.lock`` (flock, released when the process dies): True when this
    process got it, False when another eval job holds it."""
    evals_dir(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(evals_dir(run_dir) / "worker.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
