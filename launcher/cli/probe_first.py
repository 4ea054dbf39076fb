"""``plan.calibrate=true``: measure this machine before planning, for every command that plans.

``launcher.train``, ``launcher.plan`` and ``launcher.search`` plan a job; when its step time is
not measured (no stored profile of this machine measured its model and layout) and the user
asked for calibration, :func:`probe_first` runs ``python -m launcher.probe`` with the same
overrides, then the command plans again and finds the profile the probe stored. The probe is a
command of its own (a subprocess, never an import: it starts ranks), with its own run name; its
output goes to stderr, so a command's JSON on stdout stays one object.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Sequence


UNPROBED = "the probe does not measure"
"""What a plan's step-time source says when no probe could measure the layout (context
parallelism, MoE: launcher.plan.timing.unprobed, which writes it from here)."""


def needs_probe(calibrate: bool, step_time_source: str) -> bool:
    """Whether to probe first: calibration asked for and the plan's step time not measured,
    though a probe could measure it."""
    return calibrate and not step_time_source.startswith("measured") \
        and UNPROBED not in step_time_source


def probe_first(argv: Sequence[str], run_name: str, command: str) -> None:
    """Run the probe of ``argv`` (run ``<run_name>-probe``); a line when it fails (the command
    then plans from the catalogue). ``command`` names the caller in what it prints."""
    print(f"{command}: no stored profile measured this model and layout here; probing this "
          "machine first (plan.calibrate=true)", file=sys.stderr, flush=True)
    probe = [sys.executable, "-m", "launcher.probe", *argv, "plan.calibrate=false",
             f"run.name={run_name or 'run'}-probe"]
    if subprocess.run(probe, stdout=sys.stderr.fileno()).returncode != 0:
        print(f"{command}: the probe failed (above); planning from the catalogue",
              file=sys.stderr, flush=True)
