"""trainer.precision=auto: bf16 where the device computes it fast, fp32 elsewhere; an explicit
bf16 where it is slow is kept with a warning giving the measured slowdown. Both kinds of CPU
are covered with the timing injected (a stored profile or a timer), whatever this machine is."""

from __future__ import annotations

import json

import pytest

from launcher.compose import compose_config, to_object
from launcher.config import Precision
from launcher.plan import compute_plan
from launcher.plan.hardware import resolve_device
from launcher.plan.machine import CpuInfo
from launcher.plan.precision import (CHECK_SIZE, PrecisionTiming, choose_precision,
                                     precision_choice)
from tests.helpers.cpu_check import store_check

CPU = resolve_device("cpu")
EPYC = CpuInfo("AMD EPYC 7B13 64-Core Processor", frozenset({"avx2", "fma"}), 2)
SAPPHIRE = CpuInfo("Intel(R) Xeon(R) Platinum 8480+",
                   frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}), 2)
SLOW = PrecisionTiming(256, fp32_s=0.001, bf16_s=0.078, stream_bytes_per_s=8e9,  # emulated: 78x
                       adam_seconds_per_param=7e-9)
FAST = PrecisionTiming(256, fp32_s=0.0002, bf16_s=0.00005, stream_bytes_per_s=12e9,
                       adam_seconds_per_param=3e-9)


def test_a_gpu_trains_bf16():
    choice = choose_precision(Precision.auto, resolve_device("H100"))
    assert choice.precision == Precision.bf16 and "bf16 tensor cores" in choice.reason
    assert choose_precision(Precision.fp32, resolve_device("H100")).precision == Precision.fp32


@pytest.mark.parametrize("cpu,timing,expected", [
    (EPYC, None, Precision.fp32), (EPYC, SLOW, Precision.fp32),
    (SAPPHIRE, None, Precision.bf16), (SAPPHIRE, FAST, Precision.bf16),
    (SAPPHIRE, SLOW, Precision.fp32)])  # the flags say fast, the timing says otherwise: timing wins
def test_auto_on_a_cpu_follows_its_bf16_speed(cpu, timing, expected):
    choice = choose_precision(Precision.auto, CPU, cpu=cpu, timing=timing)
    assert choice.precision == expected and not choice.warning
    assert cpu.model in choice.reason
    if timing is not None:
        assert f"{timing.bf16_s * 1e3:.2f} ms in bf16" in choice.reason
    elif expected == Precision.fp32:
        assert "neither AMX nor AVX512-BF16" in choice.reason


def test_an_explicit_bf16_on_a_slow_cpu_is_kept_with_the_measured_slowdown():
    choice = choose_precision(Precision.bf16, CPU, cpu=EPYC, timing=SLOW)
    assert choice.precision == Precision.bf16
    assert "78x slower than fp32" in choice.warning
    assert "trainer.precision=auto or fp32" in choice.warning
    assert not choose_precision(Precision.bf16, CPU, cpu=SAPPHIRE, timing=FAST).warning
    assert not choose_precision(Precision.fp32, CPU, cpu=EPYC, timing=SLOW).warning


def _cfg(*overrides):
    return to_object(compose_config(["cluster=local_cpu", *overrides]))


def test_the_check_is_timed_once_then_read_from_the_profile(tmp_path, monkeypatch):
    monkeypatch.setattr("launcher.plan.precision.cpu_info", lambda: SAPPHIRE)
    cfg = _cfg(f"plan.profile_dir={tmp_path}")
    calls = []

    def timer(n):
        calls.append(n)
        return SLOW.fp32_s, SLOW.bf16_s, SLOW.stream_bytes_per_s, SLOW.adam_seconds_per_param

    first = precision_choice(cfg, CPU, ranks=2, measure=True, timer=timer)
    assert calls == [CHECK_SIZE] and first.precision == Precision.fp32
    stored = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert stored["figures"]["precision"]["bf16_s"] == SLOW.bf16_s
    assert stored["figures"]["precision"]["stream_bytes_per_s"] == SLOW.stream_bytes_per_s
    assert stored["figures"]["precision"]["adam_seconds_per_param"] == SLOW.adam_seconds_per_param
    assert stored["model"] == SAPPHIRE.model and stored["source"] == "precision check"

    def no_timer(n):
        raise AssertionError("timed again")

    again = precision_choice(cfg, CPU, ranks=2, measure=True, timer=no_timer)
    assert again == first


def test_without_bf16_flags_auto_is_fp32_without_a_timing(tmp_path, monkeypatch):
    monkeypatch.setattr("launcher.plan.precision.cpu_info", lambda: EPYC)
    cfg = _cfg(f"plan.profile_dir={tmp_path}")
    choice = precision_choice(cfg, CPU, ranks=2, measure=False)
    assert choice.precision == Precision.fp32 and choice.timing is None
    assert "neither AMX nor AVX512-BF16" in choice.reason


@pytest.mark.parametrize("stored", [
    PrecisionTiming(256, fp32_s=0.001, bf16_s=0.078),
    PrecisionTiming(256, fp32_s=0.001, bf16_s=0.078, stream_bytes_per_s=8e9)],
    ids=["before_the_streaming_add", "before_the_adamw_step"])
def test_a_profile_stored_before_a_figure_was_checked_is_timed_again(tmp_path, stored):
    """A check stored without ``stream_bytes_per_s`` or ``adam_seconds_per_param`` (before the
    plan's CPU rates needed them) is completed once, then read."""
    store_check(tmp_path, stored)
    cfg = _cfg(f"plan.profile_dir={tmp_path}", "trainer.precision=fp32")
    calls = []

    def timer(n):
        calls.append(n)
        return SLOW.fp32_s, SLOW.bf16_s, SLOW.stream_bytes_per_s, SLOW.adam_seconds_per_param

    assert precision_choice(cfg, CPU, ranks=2, measure=True, timer=timer).timing == SLOW
    assert precision_choice(cfg, CPU, ranks=2, measure=True, timer=timer).timing == SLOW
    assert calls == [CHECK_SIZE]


@pytest.mark.parametrize("timing,expected", [(SLOW, "fp32"), (FAST, "bf16")])
def test_the_plan_shows_the_choice_and_why(tmp_path, timing, expected):
    store_check(tmp_path, timing)
    plan = compute_plan(_cfg(f"plan.profile_dir={tmp_path}"))
    assert plan.precision == expected and plan.to_dict()["precision"] == expected
    assert plan.precision_reason.startswith("auto: bf16 is ")
    elem = 4 if expected == "fp32" else 2  # the memory and time follow the choice
    state = plan.memory.per_gpu.weights / plan.params.per_gpu
    assert state == elem


def test_the_plan_warns_about_an_explicit_slow_bf16(tmp_path):
    store_check(tmp_path, SLOW)
    plan = compute_plan(_cfg(f"plan.profile_dir={tmp_path}", "trainer.precision=bf16"))
    assert plan.precision == "bf16"
    assert any("78x slower than fp32" in w for w in plan.warnings)


def test_a_job_records_the_precision_it_trains_in(tmp_path):
    from launcher.launch.job import prepare

    store_check(tmp_path, SLOW)
    job = prepare([f"plan.profile_dir={tmp_path}", f"run.output_root={tmp_path}",
                   "data=mock"])
    assert job.cfg.trainer.precision == Precision.fp32
    assert job.config["trainer"]["precision"] == "fp32"
    assert any(note.startswith("precision fp32: auto: bf16 is slow") for note in job.notes)
