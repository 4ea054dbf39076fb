"""A module for :mod:`launcher.launch.rank_preload`'s tests: it records the process that imported
it, and its rank entry writes what a rank sees."""

from __future__ import annotations

import json
import os
from pathlib import Path

IMPORTED_BY = os.getpid()
"""The pid of the process that imported this module."""

if os.environ.get("TW_SLOW_IMPORT"):  # an import as long as a test needs
    import time

    time.sleep(float(os.environ["TW_SLOW_IMPORT"]))


def report(out_dir: str) -> None:
    """A rank's entry: its pid, parent, the importer of this module and a few variables, as
    ``<out_dir>/rank<RANK>.json``."""
    names = ("RANK", "WORLD_SIZE", "TW_SET_AFTER", "TW_REMOVED_AFTER", "TW_BEFORE")
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "imported_by": IMPORTED_BY,
        "env": {k: os.environ.get(k) for k in names}}))
