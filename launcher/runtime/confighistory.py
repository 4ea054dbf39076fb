"""A run directory's config history: a failed start never overwrites the last good config.

    run_dir/
      config.yaml, plan.json,   the config, plan and data of the last start that got going
      data.json                 (its checkpoint loaded, or its fresh engine built)
      configs/
        attempt_0001_<UTC>.yaml  every start's config, in order, whether it got going or not
        attempt_0002_<UTC>.yaml  (attempt 1 is the config.yaml found at the first restart)

The first start of a run directory writes config.yaml, plan.json and data.json at once: there is
no earlier run to protect, and no history yet. A restart (config.yaml exists) only adds its
config as the next attempt, creating ``configs/`` with the existing config.yaml as attempt 1 the
first time; the three files are rewritten only once the start has loaded its checkpoint
(:func:`launcher.runtime.rundir.write_run_files`, called from
:func:`launcher.runtime.resume.started`). So after a refused resume ``config.yaml`` still
describes the run that wrote the checkpoints, and the newest attempt shows what was tried.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Optional

from launcher.core.atomic import atomic_write_text

__all__ = ["HISTORY_DIR", "attempts", "record_attempt"]

HISTORY_DIR = "configs"
"""Sub-directory of the run directory holding one config per start."""

_ATTEMPT_RE = re.compile(r"^attempt_(\d+)_.*\.yaml$")


def _stamp(when: datetime.datetime) -> str:
    return when.astimezone(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def attempts(run_dir: Path) -> list[Path]:
    """The recorded attempts' configs, oldest first."""
    found = [(int(m.group(1)), p) for p in (Path(run_dir) / HISTORY_DIR).glob("attempt_*.yaml")
             if (m := _ATTEMPT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def record_attempt(run_dir: Path, config_yaml: str,
                   now: Optional[datetime.datetime] = None) -> Path:
    """Write ``config_yaml`` as the next ``configs/attempt_<n>_<UTC time>.yaml`` of ``run_dir``
    (atomically); the first time, the run directory's current config.yaml becomes attempt 1
    (stamped with its modification time). Returns the new file."""
    run_dir = Path(run_dir)
    history = run_dir / HISTORY_DIR
    history.mkdir(parents=True, exist_ok=True)
    previous = attempts(run_dir)
    current = run_dir / "config.yaml"
    if not previous and current.is_file():
        mtime = datetime.datetime.fromtimestamp(current.stat().st_mtime, datetime.timezone.utc)
        first = history / f"attempt_0001_{_stamp(mtime)}.yaml"
        atomic_write_text(first, current.read_text(encoding="utf-8"))
        previous = [first]
    number = int(_ATTEMPT_RE.match(previous[-1].name).group(1)) + 1 if previous else 1
    now = now or datetime.datetime.now(datetime.timezone.utc)
    path = history / f"attempt_{number:04d}_{_stamp(now)}.yaml"
    atomic_write_text(path, config_yaml)
    return path
