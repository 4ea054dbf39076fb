"""A CPU check (launcher/plan/precision.py) stored as this machine's profile, so that a test
plans with the timing it chose, whatever this machine is."""

from __future__ import annotations

from pathlib import Path

from launcher.plan.machine import cpu_info, library_versions
from launcher.plan.precision import SECTION, PrecisionTiming
from launcher.plan.profile import MachineProfile, save_figures


def store_check(directory: Path, timing: PrecisionTiming, ranks: int = 2) -> None:
    """``timing`` as the check of this CPU with ``ranks`` ranks, in the profile ``directory``."""
    me = MachineProfile(device="cpu", model=cpu_info().model, ranks=ranks, threads_per_rank=1,
                        versions=library_versions())
    save_figures(directory, me, {SECTION: {
        "n": timing.n, "fp32_s": timing.fp32_s, "bf16_s": timing.bf16_s,
        "stream_bytes_per_s": timing.stream_bytes_per_s,
        "adam_seconds_per_param": timing.adam_seconds_per_param, "threads": 1}}, "test")
