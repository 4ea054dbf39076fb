"""Durations written the way schedulers write them."""

from __future__ import annotations


def slurm_time_limit_s(limit: str) -> int:
    """Slurm's ``D-HH:MM:SS`` / ``HH:MM:SS`` / ``MM:SS`` / ``MM`` time limit in seconds."""
    days, _, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    h, m, s = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s
