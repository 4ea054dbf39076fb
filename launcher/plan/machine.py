"""What this machine is, read without torch: the CPU's model and instruction sets, and the
versions of the libraries a step's speed depends on.

The plan matches a stored machine profile (:mod:`launcher.plan.profile`) against these, and the
precision choice (:mod:`launcher.plan.precision`) reads the CPU's bf16 instruction sets here.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from importlib import metadata

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of CPUs that compute bf16 matrix products natively (Intel AMX, AVX512-BF16
on Cooper Lake and later, AMD Zen 4 and later); without them PyTorch emulates bf16 in fp32
arithmetic with conversions, about 80x slower than fp32 on an AVX2 EPYC (issue 36)."""
LIBRARIES = ("torch", "megatron-core", "deepspeed", "transformer-engine")
"""Libraries whose version changes the speed of a step (a profile taken with others is not
reused)."""


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as /proc/cpuinfo describes it."""

    model: str
    """The "model name" line, e.g. "AMD EPYC 7B13" ("" when unreadable)."""
    flags: frozenset
    """Instruction-set flags."""
    logical_cores: int

    @property
    def bf16_flags(self) -> tuple[str, ...]:
        """Of :data:`BF16_CPU_FLAGS`, those this CPU has."""
        return tuple(f for f in BF16_CPU_FLAGS if f in self.flags)


@functools.lru_cache(maxsize=1)
def cpu_info(path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU (the first processor's entry; every core of a node is alike)."""
    model, flags = "", frozenset()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return CpuInfo(model or platform.processor() or platform.machine(), flags,
                   os.cpu_count() or 1)


@functools.lru_cache(maxsize=1)
def library_versions() -> dict:
    """{library: version} of :data:`LIBRARIES` installed here (absent ones left out)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out
