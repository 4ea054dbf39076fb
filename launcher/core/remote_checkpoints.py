"""The checkpoint layout on object storage, torch-free: what makes a step visible there, which
step a run resumes from, and what keep-k deletes.

An object store has no rename and no directories, so the local protocol (write ``.tmp``, rename,
move a ``latest`` symlink) does not carry over. Under ``trainer.checkpoint_uri``::

    step_000100/<the step directory's files>   uploaded by every rank, each its own share
    step_000100/complete                       the commit record, written LAST, by rank 0, once
                                               every rank confirmed every one of its objects:
                                               JSON {step, files: {path: bytes}, bytes}
    latest                                     "step_000100", written after the commit (for
                                               people and tools; resume does not need it)

A step is committed if and only if its ``complete`` object exists; resume lists the step
folders and takes the newest committed one, so a crash between the commit and ``latest`` loses
nothing, and a partial upload (a rank or the server killed mid-save) is never resumed. A load
reads exactly the files of the commit record and checks each one's size. keep-k deletes an old
step's commit record first (it is then invisible), then its objects, and only after a newer
step committed; uncommitted folders older than the newest commit are debris and go too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from launcher.core.checkpoints import COMPLETE, LATEST, step_name
from launcher.core.errors import CheckpointError
from launcher.core.objectstore import (ObjectURI, delete_folder, delete_keys, get_text,
                                       list_folders, put_text)

_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Commit:
    """A committed step on the store."""

    uri: ObjectURI
    """The step's folder (``.../step_000100``)."""
    step: int
    files: dict
    """Path inside the step directory -> bytes: exactly what a load reads."""

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    def record(self) -> str:
        return json.dumps({"step": self.step, "files": dict(sorted(self.files.items())),
                           "bytes": self.bytes}, indent=1) + "\n"


def read_commit(step_uri: ObjectURI, deadline: float) -> Optional[Commit]:
    """The commit record of a step folder; None when the step is not committed. A record that
    does not parse raises CheckpointError naming it."""
    text = get_text(step_uri.child(COMPLETE), deadline)
    if text is None:
        return None
    try:
        record = json.loads(text)
        files = {str(k): int(v) for k, v in record["files"].items()}
        return Commit(step_uri, int(record["step"]), files)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{step_uri.child(COMPLETE)} is not a commit record ({exc}); "
                              "delete that step's folder or point trainer.load elsewhere") from exc


def step_folders(uri: ObjectURI, deadline: float) -> list[tuple[int, ObjectURI]]:
    """Every ``step_<N>`` folder under ``uri``, committed or not, oldest first."""
    found = [(int(m.group(1)), uri.child(name)) for name in list_folders(uri, deadline)
             if (m := _STEP_RE.match(name))]
    return sorted(found, key=lambda item: item[0])


def committed(uri: ObjectURI, deadline: float) -> list[Commit]:
    """The committed steps under ``uri``, oldest first."""
    commits = (read_commit(folder, deadline) for _, folder in step_folders(uri, deadline))
    return [c for c in commits if c is not None]


def newest(uri: ObjectURI, deadline: float) -> Optional[Commit]:
    """The newest committed step under ``uri`` (None: nothing committed), reading the commit
    records newest first only until one is found."""
    for _, folder in reversed(step_folders(uri, deadline)):
        commit = read_commit(folder, deadline)
        if commit is not None:
            return commit
    return None


def commit(step_uri: ObjectURI, step: int, files: dict, deadline: float) -> Commit:
    """Make a step visible: its commit record, then ``latest`` beside the step folders."""
    done = Commit(step_uri, step, dict(files))
    put_text(step_uri.child(COMPLETE), done.record(), deadline)
    parent = ObjectURI(step_uri.bucket, step_uri.prefix.rpartition("/")[0])
    put_text(parent.child(LATEST), step_name(step) + "\n", deadline)
    return done


def clear(step_uri: ObjectURI, deadline: float) -> None:
    """Remove a step folder: its commit record first (it stops being visible at once), then
    every object and unfinished upload under it."""
    delete_keys(step_uri.bucket, [step_uri.child(COMPLETE).prefix], deadline)
    delete_folder(step_uri, deadline)


def prune(uri: ObjectURI, keep_last: int, deadline: float) -> list[int]:
    """After a commit: delete committed steps beyond the newest ``keep_last`` (0 = keep all)
    and uncommitted folders older than the newest commit; the steps deleted."""
    folders = step_folders(uri, deadline)
    commits = {c.step: c for c in (read_commit(f, deadline) for _, f in folders) if c}
    if not commits:
        return []
    newest_step = max(commits)
    kept = set(sorted(commits)[-keep_last:]) if keep_last > 0 else set(commits)
    gone = [step for step, _ in folders if step not in kept
            and (step in commits or step < newest_step)]
    for step, folder in folders:
        if step in gone:
            clear(folder, deadline)
    return gone


def resolve(uri: ObjectURI, deadline: float) -> Optional[Commit]:
    """What ``uri`` names: a step folder (it must be committed) or a checkpoints prefix (its
    newest commit; None when it has none)."""
    if _STEP_RE.match(uri.prefix.rpartition("/")[2]):
        found = read_commit(uri, deadline)
        if found is None:
            raise CheckpointError(f"checkpoint {uri} is not committed (no {COMPLETE} object): "
                                  "its upload never finished; use an earlier step")
        return found
    return newest(uri, deadline)
