"""``trainer.precision=auto``: bf16 where the device computes it fast, fp32 elsewhere.

* A catalogue GPU (A100, H100, H200, B200) has bf16 tensor cores: bf16.
* A CPU computes bf16 natively only with AMX or AVX512-BF16 (:data:`launcher.plan.machine.
  BF16_CPU_FLAGS`); elsewhere PyTorch emulates it (a 1024^3 matmul: 3.9 s in bf16, 0.05 s in
  fp32 on an AVX2 EPYC). The flags are a first answer; a short matmul timed in both dtypes
  (:data:`CHECK_SIZE`, single-threaded, a few milliseconds where bf16 is fast) confirms it:
  bf16 only when it is at least as fast as fp32. The timing is stored in the machine profile
  (:mod:`launcher.plan.profile`, section ``precision``), so one check serves later plans.

The same check times a streaming add and one AdamW step; with the matmuls they give the plan
this CPU's own rates (:mod:`launcher.plan.cpu_rates`), so it runs on every CPU, whatever the
precision asked.

An explicit ``bf16`` (or ``fp16``) where it is slow is honoured, with a plan warning that gives
the measured slowdown. :func:`choose_precision` is pure; :func:`precision_choice` reads the CPU,
the stored profile and (``measure``) times the check.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from launcher.config import Precision, TrainwrightConfig
from launcher.plan.hardware import Device
from launcher.plan.machine import CpuInfo, cpu_info, library_versions
from launcher.plan.profile import MachineProfile, matching_profile, profile_dir, save_figures

CHECK_SIZE = 256
"""Side of the square matmul the precision check times in both dtypes."""
SECTION = "precision"
"""The profile section of the check: {"n", "fp32_s", "bf16_s", "stream_bytes_per_s",
"adam_seconds_per_param", "threads"}."""


@dataclass(frozen=True)
class PrecisionTiming:
    """One square matmul of side ``n`` timed in fp32 and bf16 (median seconds, one thread)."""

    n: int
    fp32_s: float
    bf16_s: float
    stream_bytes_per_s: float = 0.0
    """Bytes per second a streaming add moves on one thread; 0 = not timed (a profile stored
    before the check timed it)."""
    adam_seconds_per_param: float = 0.0
    """Seconds per parameter of one AdamW step as the engines run it on a CPU (torch's
    multi-tensor path, fp32, one thread, a tensor past the allocator's reuse ceiling as a
    model's are); 0 = not timed (a profile stored before the check timed it)."""

    @property
    def complete(self) -> bool:
        """Every figure the plan's CPU rates read was timed."""
        return self.stream_bytes_per_s > 0 and self.adam_seconds_per_param > 0

    def matmul_flops_per_s(self, precision: Precision) -> float:
        """FLOP/s of the check's matmul in ``precision`` (fp32, else bf16)."""
        seconds = self.fp32_s if precision == Precision.fp32 else self.bf16_s
        return 2.0 * self.n ** 3 / seconds if seconds > 0 else 0.0

    @property
    def bf16_slowdown(self) -> float:
        """bf16 time / fp32 time (below 1: bf16 is faster)."""
        return self.bf16_s / self.fp32_s if self.fp32_s > 0 else 1.0

    def text(self) -> str:
        return (f"a {self.n}^3 matmul takes {self.bf16_s * 1e3:.2f} ms in bf16, "
                f"{self.fp32_s * 1e3:.2f} ms in fp32")


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run trains in, and why."""

    precision: Precision
    reason: str
    warning: str = ""
    """Set when an explicit bf16/fp16 is slow on this device."""
    timing: Optional[PrecisionTiming] = None
    """This CPU's check (a cpu run's, stored or timed now); None on a GPU or when not timed."""


def choose_precision(asked: Precision, device: Device, *, cpu: Optional[CpuInfo] = None,
                     timing: Optional[PrecisionTiming] = None) -> PrecisionChoice:
    """The precision for ``asked`` on ``device`` (module docstring); ``cpu`` and ``timing``
    describe the CPU a cpu run uses (None: unknown / not timed)."""
    if device.name != "cpu":
        if asked != Precision.auto:
            return PrecisionChoice(asked, "trainer.precision as set")
        return PrecisionChoice(Precision.bf16, f"auto: the {device.name} has bf16 tensor cores "
                               f"({device.peak_tflops_bf16:g} vs {device.peak_tflops_fp32:g} "
                               "TFLOP/s in fp32)")
    fast, why = _cpu_bf16_fast(cpu, timing)
    if asked == Precision.auto:
        return PrecisionChoice(Precision.bf16 if fast else Precision.fp32, f"auto: {why}",
                               timing=timing)
    warning = ""
    if asked in (Precision.bf16, Precision.fp16) and not fast:
        slower = (f"{timing.bf16_slowdown:.0f}x slower than fp32 here ({timing.text()})"
                  if timing is not None else "emulated here, typically 10-80x slower than fp32")
        warning = (f"trainer.precision={asked.value} on this CPU: {why}; bf16 matmuls are "
                   f"{slower}; trainer.precision=auto or fp32 trains at full speed")
    return PrecisionChoice(asked, "trainer.precision as set", warning, timing)


def _cpu_bf16_fast(cpu: Optional[CpuInfo], timing: Optional[PrecisionTiming]) -> tuple[bool, str]:
    """(whether bf16 is fast on this CPU, why)."""
    model = f" ({cpu.model})" if cpu is not None and cpu.model else ""
    if timing is not None:
        if timing.bf16_slowdown <= 1.0:
            return True, f"bf16 is fast on this CPU{model}: {timing.text()}"
        return False, f"bf16 is slow on this CPU{model}: {timing.text()}"
    flags = cpu.bf16_flags if cpu is not None else ()
    if flags:
        return True, f"this CPU{model} has {' and '.join(flags)} (not timed)"
    return False, (f"this CPU{model} has neither AMX nor AVX512-BF16: PyTorch emulates bf16, "
                   "so fp32 is faster")


Timer = Callable[[int], tuple]
"""(fp32 seconds, bf16 seconds of the matmul at side n, streamed bytes per second, AdamW
seconds per parameter): the engines' :func:`launcher.engines.probe.cpu_check`."""


def precision_choice(cfg: TrainwrightConfig, device: Device, *, ranks: int, measure: bool,
                     timer: Optional[Timer] = None) -> PrecisionChoice:
    """The choice for ``cfg`` on ``device``: a cpu run's CPU is this machine's; its timing is
    the stored profile's, else (``measure``) timed now and stored (the plan's CPU rates need
    it whatever the precision)."""
    asked = Precision(cfg.trainer.precision)
    if device.name != "cpu":
        return choose_precision(asked, device)
    cpu = cpu_info()
    timing = stored_timing(cfg, cpu, ranks)
    if (timing is None or not timing.complete) and measure:
        timing = _timed_and_stored(cfg, cpu, ranks, timer)
    if asked not in (Precision.auto, Precision.bf16, Precision.fp16):
        return PrecisionChoice(asked, "trainer.precision as set", timing=timing)
    return choose_precision(asked, device, cpu=cpu, timing=timing)


def _identity(cpu: CpuInfo, ranks: int) -> MachineProfile:
    import os

    return MachineProfile(device="cpu", model=cpu.model, ranks=ranks,
                          threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "1") or 1),
                          versions=library_versions())


def stored_timing(cfg: TrainwrightConfig, cpu: CpuInfo, ranks: int) -> Optional[PrecisionTiming]:
    """The precision check of this machine's stored profile, if any."""
    me = _identity(cpu, ranks)
    found, _ = matching_profile(profile_dir(cfg.plan.profile_dir), device="cpu", model=cpu.model,
                                ranks=ranks, versions=me.versions)
    record = found.figures.get(SECTION) if found is not None else None
    try:
        return PrecisionTiming(int(record["n"]), float(record["fp32_s"]), float(record["bf16_s"]),
                               float(record.get("stream_bytes_per_s", 0.0)),
                               float(record.get("adam_seconds_per_param", 0.0)))
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def _timed_and_stored(cfg: TrainwrightConfig, cpu: CpuInfo, ranks: int,
                      timer: Optional[Timer]) -> Optional[PrecisionTiming]:
    if timer is None:
        from launcher.engines.probe import cpu_check as timer
    timing = PrecisionTiming(CHECK_SIZE, *timer(CHECK_SIZE))
    try:
        save_figures(profile_dir(cfg.plan.profile_dir), _identity(cpu, ranks),
                     {SECTION: {"n": timing.n, "fp32_s": timing.fp32_s,
                                "bf16_s": timing.bf16_s,
                                "stream_bytes_per_s": timing.stream_bytes_per_s,
                                "adam_seconds_per_param": timing.adam_seconds_per_param,
                                "threads": 1}}, "precision check")
    except OSError:
        pass  # an unwritable cache only costs the next plan another check
    return timing


def resolve_precision(cfg: TrainwrightConfig, *, measure: bool = True) -> TrainwrightConfig:
    """``cfg`` with ``trainer.precision=auto`` resolved for its cluster (for commands that
    build without a plan, e.g. generate); unchanged when cluster.gpu is unknown (the plan, or
    the command, reports that)."""
    from launcher.plan.hardware import resolve_device

    c = cfg.cluster
    try:
        device = resolve_device(c.gpu, c.device_memory_gb, c.peak_tflops)
    except KeyError:
        return cfg
    choice = precision_choice(cfg, device, ranks=c.gpus_per_node * c.ranks_per_gpu,
                              measure=measure)
    return with_precision(cfg, choice.precision)


def with_precision(cfg: TrainwrightConfig, precision: Precision) -> TrainwrightConfig:
    """``cfg`` training in ``precision``."""
    if cfg.trainer.precision == precision:
        return cfg
    return replace(cfg, trainer=replace(cfg.trainer, precision=precision))
