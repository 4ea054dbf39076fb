"""Kernel timings for the machine probe and the plan's CPU check (torch objects are built here,
in the engines layer; :mod:`launcher.runtime.probe` runs them on the job's ranks)."""

from launcher.engines.probe.kernels import cpu_check, median_seconds, precision_timing

__all__ = ["cpu_check", "median_seconds", "precision_timing"]
