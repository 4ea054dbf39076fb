"""Which folder holds each of lm-evaluation-harness's own tasks, kept on disk.

lm-evaluation-harness 0.4's ``TaskManager`` finds a task by reading every task file it ships
(14,683 names; 14 s on the 2-core AVX2 EPYC), and every process that loaded one of its tasks paid
that, some twice: the launcher's check before the ranks, each rank, each eval job. The index here
(task name -> its folder, relative to the harness's task folder) is built once per installed
harness, by its own ``TaskManager``, and stored as ``$TRAINWRIGHT_CACHE/lm_eval_tasks/<stamp>.json``
(written whole or not at all); a process then gives ``TaskManager`` only the folders of the tasks
it names (a few milliseconds). The stamp is the harness's version, its folder, and the count and
newest modification time of its task files (0.2 s to read), so an upgrade or an edited task file
builds a new index. Torch-free; lm-evaluation-harness is imported by the builder only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Optional

from launcher.core.atomic import atomic_write_json
from launcher.core.shard_cache import cache_root

TASK_FILES = (".yaml", ".yml", ".py")
"""What the stamp counts: the task definitions and the helpers they name (``!function``)."""


def harness_root() -> Path:
    """lm-evaluation-harness's own task folder."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval.tasks")
    return Path(spec.origin).parent


def stamp(root: Path) -> dict:
    """What the index depends on: the harness's version, its task folder and its task files."""
    from importlib.metadata import version

    count, newest = 0, 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(TASK_FILES):
                count += 1
                newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime_ns)
    return {"version": version("lm_eval"), "root": str(root), "files": count,
            "newest_ns": newest}


def index_path(of: dict) -> Path:
    digest = hashlib.sha256(json.dumps(of, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "lm_eval_tasks" / f"{digest}.json"


def task_index(root: Optional[Path] = None) -> dict:
    """{task name: its folder relative to ``root``} (default: the harness's), from the stored
    index when its stamp still holds, else built and stored."""
    root = root or harness_root()
    now = stamp(root)
    path = index_path(now)
    try:
        stored = json.loads(path.read_text())
        if stored.get("stamp") == now:
            return stored["tasks"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    tasks = build(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"stamp": now, "tasks": tasks})
    except OSError:  # a read-only cache: the next process builds it again
        pass
    return tasks


def build(root: Path) -> dict:
    """The index, by lm-evaluation-harness's own ``TaskManager`` over ``root`` (the slow part)."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[str(root)], include_defaults=False)
    return {name: str(Path(entry.yaml_path).parent.relative_to(root))
            for name, entry in manager.task_index.items()
            if entry.yaml_path is not None and Path(entry.yaml_path).is_relative_to(root)}


def task_folders(names: Iterable[str], root: Optional[Path] = None) -> list[Path]:
    """The folders that hold those of ``names`` the harness ships (others are left out: a name
    of another include path, or one that exists nowhere, which its caller reports)."""
    root = root or harness_root()
    index = task_index(root)
    return sorted({root / index[name] for name in names if name in index})
