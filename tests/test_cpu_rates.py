"""An uncalibrated CPU plan prices its steps at this machine's own check (launcher/plan/
cpu_rates.py): the matmul rate in the training precision and the streaming rate, not the
catalogue's placeholder. The check is injected as a stored profile, whatever this machine is."""

from __future__ import annotations

import pytest

from launcher.compose import compose_config, to_object
from launcher.plan import compute_plan
from launcher.plan.cpu_rates import CPU_GEMM_EFFICIENCY
from launcher.plan.precision import PrecisionTiming
from tests.helpers.cpu_check import store_check

CHECK = PrecisionTiming(256, fp32_s=0.0005, bf16_s=0.0004, stream_bytes_per_s=10e9,
                        adam_seconds_per_param=6e-9)
EMULATED_BF16 = PrecisionTiming(256, fp32_s=0.0005, bf16_s=0.04, stream_bytes_per_s=10e9,
                                adam_seconds_per_param=6e-9)


def _plan(directory, *overrides):
    cfg = to_object(compose_config(["cluster=local_cpu", "model=tiny", "engine=megatron",
                                    f"plan.profile_dir={directory}", *overrides]))
    return compute_plan(cfg)


def _stored_plan(tmp_path, name, timing, *overrides):
    directory = tmp_path / name
    store_check(directory, timing)
    return _plan(directory, *overrides)


def test_the_plan_prices_a_cpu_at_its_checks_matmul_rate(tmp_path):
    plan = _stored_plan(tmp_path, "check", CHECK, "trainer.precision=fp32")
    assert plan.machines.peak_tflops_per_gpu == pytest.approx(2 * 256 ** 3 / 0.0005 / 1e12)
    source = plan.sources["step time"]
    assert source.startswith("rates of this CPU's check") and "10.0 GB/s" in source
    assert "not calibrated" in source
    slower = _stored_plan(tmp_path, "slower", PrecisionTiming(256, 0.001, 0.0008, 10e9, 6e-9),
                          "trainer.precision=fp32")
    # half the matmul rate, the same streaming rate: the matmuls take twice as long
    assert slower.compute.parts["compute"] > 1.5 * plan.compute.parts["compute"]
    catalogue = _plan(tmp_path / "none", "trainer.precision=fp32")
    assert catalogue.sources["step time"].startswith("catalogue (cpu in")
    assert catalogue.compute.step_time_s != plan.compute.step_time_s


def test_bf16_on_a_cpu_that_emulates_it_is_planned_at_its_emulated_rate(tmp_path):
    """The issue: the plan ignored fp32 vs bf16 on a CPU although the check had timed both."""
    fp32 = _stored_plan(tmp_path, "fp32", EMULATED_BF16, "trainer.precision=fp32")
    bf16 = _stored_plan(tmp_path, "bf16", EMULATED_BF16, "trainer.precision=bf16")
    assert bf16.machines.peak_tflops_per_gpu == pytest.approx(
        fp32.machines.peak_tflops_per_gpu / 80)
    assert bf16.compute.parts["compute"] > 20 * fp32.compute.parts["compute"]
    assert any("80x slower than fp32" in w for w in bf16.warnings)


def test_the_clusters_peak_override_wins_over_the_check(tmp_path):
    plan = _stored_plan(tmp_path, "check", CHECK, "trainer.precision=fp32",
                        "cluster.peak_tflops=0.05")
    assert plan.machines.peak_tflops_per_gpu == 0.05
    assert plan.sources["step time"].startswith("catalogue (cpu in")


def test_the_step_time_follows_the_calibrated_gemm_efficiency(tmp_path, monkeypatch):
    """The efficiency constant is the one the matmuls are priced at (docs/plan.md gives its
    calibration): halving it makes the matmul share of compute twice as long."""
    plan = _stored_plan(tmp_path, "a", CHECK, "trainer.precision=fp32")
    monkeypatch.setattr("launcher.plan.cpu_rates.CPU_GEMM_EFFICIENCY", CPU_GEMM_EFFICIENCY / 2)
    halved = _plan(tmp_path / "a", "trainer.precision=fp32")
    assert plan.compute.parts["compute"] < halved.compute.parts["compute"] \
        < 2 * plan.compute.parts["compute"]


def test_deepspeeds_gpu_compute_factor_is_not_charged_on_a_cpu(tmp_path):
    """DeepSpeed's per-parameter gradient copies slow an H100 step by 1.22x; a CPU step they
    leave as Megatron-Core's (docs/plan.md, "Without a probe")."""
    store_check(tmp_path / "check", CHECK)

    def compute(cluster, engine, directory):
        cfg = to_object(compose_config([cluster, "model=tiny", f"engine={engine}",
                                        "trainer.precision=fp32", f"plan.profile_dir={directory}"]))
        return compute_plan(cfg).compute.parts["compute"]

    cpu = [compute("cluster=local_cpu", e, tmp_path / "check") for e in ("megatron", "deepspeed")]
    assert cpu[1] == pytest.approx(cpu[0])
    gpu = [compute("cluster=local_gpu", e, tmp_path / "gpu") for e in ("megatron", "deepspeed")]
    assert gpu[1] == pytest.approx(gpu[0] * 0.803 / 0.659)


def test_the_search_ranks_a_cpus_layouts_at_its_checks_rates_and_says_so(tmp_path):
    """The search said "measured: <profile>" of any profile of this machine, one that held the
    check alone included, while every candidate was priced by the model."""
    from launcher.search.search import search

    store_check(tmp_path / "check", CHECK)
    cfg = to_object(compose_config(["cluster=local_cpu", "model=tiny", "trainer.precision=fp32",
                                    f"plan.profile_dir={tmp_path / 'check'}"]))
    result = search(cfg)
    assert result.step_time_source.startswith("rates of this CPU's check")
    assert result.ranked


def test_the_optimizer_is_priced_at_the_checks_adamw_step(tmp_path):
    """gpt2_124m's DeepSpeed ZeRO-2 shard (62M parameters a rank) was planned at 0.28 s of
    optimizer from the streaming rate at a fused GPU Adam's 64 bytes a parameter; its step took
    2.6-3.0 s (1.5 s of it torch's per-tensor AdamW). The check now times the engines' AdamW."""
    gpt2 = ["model=gpt2_124m", "model.seq_length=128", "engine=deepspeed",
            "parallelism.zero_stage=2", "trainer.micro_batch_size=1", "trainer.precision=fp32"]
    twice = PrecisionTiming(256, fp32_s=0.0005, bf16_s=0.0004, stream_bytes_per_s=10e9,
                            adam_seconds_per_param=12e-9)
    plan = _stored_plan(tmp_path, "check", CHECK, *gpt2)
    slower = _stored_plan(tmp_path, "slower", twice, *gpt2)
    shard = plan.params.per_gpu / plan.dims.dp  # ZeRO-2: the optimizer steps this rank's share
    assert plan.compute.parts["optimizer"] == pytest.approx(shard * 6e-9, rel=0.01)
    assert slower.compute.parts["optimizer"] == pytest.approx(2 * plan.compute.parts["optimizer"])
    assert slower.compute.parts["compute"] == plan.compute.parts["compute"]
    assert "AdamW steps 6.0 ns a parameter" in plan.sources["step time"]
