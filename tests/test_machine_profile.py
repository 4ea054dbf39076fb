"""Machine profiles: the schema, reuse on the machine they describe only, a corrupt file refused
with a line naming it, merged figures written atomically."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.compose import compose_config, to_object
from launcher.plan import compute_plan
from launcher.plan.profile import (SCHEMA, MachineProfile, ProfileError, file_name,
                                   matching_profile, read_profile, save_figures)

VERSIONS = {"torch": "2.13.0", "megatron-core": "0.16.1", "deepspeed": "0.19.8"}
HERE = MachineProfile(device="cpu", model="AMD EPYC 7B13", ranks=2, threads_per_rank=1,
                      versions=VERSIONS)


def _match(directory, **changes):
    me = dict(device="cpu", model="AMD EPYC 7B13", ranks=2, versions=VERSIONS) | changes
    return matching_profile(directory, **me)


def test_a_saved_profile_reads_back_with_every_field(tmp_path):
    path = save_figures(tmp_path, HERE, {"matmul": [{"m": 8, "k": 8, "n": 8, "dtype": "fp32",
                                                     "seconds": 1e-6}]}, "probe")
    assert path.name == file_name(HERE) == "cpu-amd-epyc-7b13-2r.json"
    raw = json.loads(path.read_text())
    assert raw["schema"] == SCHEMA and raw["source"] == "probe" and raw["created"].endswith("Z")
    p = read_profile(path)
    assert (p.device, p.model, p.ranks, p.versions) == ("cpu", "AMD EPYC 7B13", 2, VERSIONS)
    assert p.figures["matmul"][0]["seconds"] == 1e-6 and p.label.startswith(path.name)


def test_figures_merge_by_section(tmp_path):
    save_figures(tmp_path, HERE, {"precision": {"n": 256}}, "precision check")
    save_figures(tmp_path, HERE, {"matmul": []}, "probe")
    p, _ = _match(tmp_path)
    assert set(p.figures) == {"precision", "matmul"} and p.source == "probe"
    other = MachineProfile(**{**HERE.to_dict(), "versions": {**VERSIONS, "torch": "2.14.1"}})
    save_figures(tmp_path, other, {"matmul": []}, "probe")  # new versions start afresh
    assert set(read_profile(tmp_path / file_name(HERE)).figures) == {"matmul"}


@pytest.mark.parametrize("changes,why", [
    ({"device": "H100"}, None),  # another device's profile is not mentioned at all
    ({"model": "Intel Xeon 8480+"}, "measured on 'AMD EPYC 7B13', this machine is"),
    ({"ranks": 8}, "measured with 2 rank(s) per node, the job runs 8"),
    ({"versions": {**VERSIONS, "torch": "2.14.1"}}, "torch 2.13.0 -> 2.14.1"),
])
def test_a_profile_of_another_machine_or_library_version_is_not_reused(tmp_path, changes, why):
    save_figures(tmp_path, HERE, {}, "probe")
    found, notes = _match(tmp_path, **changes)
    assert found is None
    if why is None:
        assert notes == []
    else:
        assert len(notes) == 1 and why in notes[0] and file_name(HERE) in notes[0]
    assert _match(tmp_path)[0] is not None


@pytest.mark.parametrize("content,says", [
    ("{not json", "is not a machine profile: Expecting property name"),
    ("[1, 2]", "a JSON object expected"),
    (json.dumps({"schema": 1, "device": "cpu"}), "'created' is missing"),
    (json.dumps({**HERE.to_dict(), "ranks": "two"}), "'ranks' is missing or not an integer"),
    (json.dumps({**HERE.to_dict(), "schema": 7}), "has profile schema 7"),
])
def test_a_corrupt_profile_is_refused_with_a_line_naming_it(tmp_path, content, says):
    bad = tmp_path / "cpu-amd-epyc-7b13-2r.json"
    bad.write_text(content)
    with pytest.raises(ProfileError) as caught:
        read_profile(bad)
    assert str(bad) in str(caught.value) and says in str(caught.value)
    assert "python -m launcher.probe" in str(caught.value) or "schema" in says
    found, notes = _match(tmp_path)
    assert found is None and notes == [f"ignored {caught.value}"]


def test_pass_figures_below_the_measured_micro_batches_scale_down_and_never_reach_zero():
    """Measured at micro-batches 4 and 8, where 8 cost 3x 4 (an EPYC here: the layer 51 and
    155 ms): the line through them reached zero at 2, a layer predicted free. Below the smallest
    measured size a figure scales in proportion to it; between and above, the line."""
    from launcher.plan.calibrated import Calibration

    key = {"arch": "gpt", "hidden_size": 64}
    rows = [{"key": {**key, "tp": 1, "micro_batch": b}, "layer_s": s, "embedding_s": s / 50,
             "output_s": s / 2} for b, s in ((4, 0.051), (8, 0.155))]
    cal = Calibration(MachineProfile(**{**HERE.to_dict(), "figures": {"passes": rows}}))
    assert cal.passes(key, 1, 2).layer == pytest.approx(0.051 / 2)
    assert cal.passes(key, 1, 1).output == pytest.approx(0.051 / 2 / 4)
    assert cal.passes(key, 1, 6).layer == pytest.approx((0.051 + 0.155) / 2)
    assert cal.passes(key, 1, 16).layer == pytest.approx(0.155 + 2 * (0.155 - 0.051))
    assert cal.passes(key, 2, 4) is None  # no figures at this tensor-parallel size


def test_a_groups_collective_is_looked_up_by_its_size():
    """A probe of 8 ranks measures groups of 2, 4 and 8: a TP2 group's all-reduce is priced
    at the 2-rank figure (today's lookup mixed every size into one line: 8 ranks' figures for
    a pair); a size never measured takes the nearest measured one, the larger of two as near;
    a profile from before group sizes (world only) still answers."""
    from launcher.parallel.collectives import group_sizes
    from launcher.plan.calibrated import Calibration

    assert group_sizes(8) == [2, 4, 8] and group_sizes(6) == [2, 6] and group_sizes(1) == []
    rows = [{"key": {"op": "all_reduce", "bytes": b, "ranks": n}, "seconds": b * n * 1e-9}
            for n in (2, 8) for b in (1e6, 1e8)]
    cal = Calibration(MachineProfile(**{**HERE.to_dict(), "ranks": 8,
                                        "figures": {"collectives": rows}}))
    assert cal.collective("all_reduce", 1e7, 2) == pytest.approx(1e7 * 2e-9)
    assert cal.collective("all_reduce", 1e7, 8) == pytest.approx(1e7 * 8e-9)
    assert cal.collective("all_reduce", 1e7, 4) == pytest.approx(1e7 * 8e-9)  # 2 and 8: a tie
    assert cal.collective("all_reduce", 1e7, 3) == pytest.approx(1e7 * 2e-9)
    assert cal.collective("all_gather", 1e7, 2) is None
    world_only = Calibration(MachineProfile(**{**HERE.to_dict(), "figures": {"collectives": [
        r for r in rows if r["key"]["ranks"] == 8]}}))
    assert world_only.collective("all_reduce", 1e7, 2) == pytest.approx(1e7 * 8e-9)


TINY_FP32 = ["model=tiny", "engine=megatron", "cluster=local_cpu", "trainer.precision=fp32"]


def _tiny_profile(directory, engine_seconds: float, per_micro_batch: float = 0.0) -> None:
    """This machine's profile of the tiny model: passes at TP 1 and 2, every collective, AdamW,
    and the engine at DP2 (one and two layers) taking ``engine_seconds`` a step at full depth;
    with ``per_micro_batch``, also at one layer with twice the micro-batches, taking its composed
    parts' extra micro-batch and ``per_micro_batch`` seconds more."""
    from launcher.parallel.collectives import COLLECTIVE_OPS
    from launcher.plan.calibrated import engine_key_of, model_key
    from launcher.plan.machine import cpu_info, library_versions

    cfg = to_object(compose_config(TINY_FP32))
    plan = compute_plan(cfg)
    key = model_key(dataclasses.asdict(cfg.model), cfg.trainer.precision)
    passes = [{"key": {**key, "tp": tp, "micro_batch": b}, "layer_s": 0.02 * b / tp,
               "embedding_s": 0.001 * b, "output_s": 0.01 * b / tp}
              for tp in (1, 2) for b in (4, 8)]
    collectives = [{"key": {"op": op, "bytes": n, "ranks": 2}, "seconds": 1e-4 + n * 1e-10}
                   for op in COLLECTIVE_OPS for n in (8, 1 << 20)]
    layout = engine_key_of(cfg, plan.dims, plan.batch.grad_accum_steps)
    engine = [{"key": layout, "layers": n, "seconds": engine_seconds * n / cfg.model.num_layers}
              for n in (1, 2)]  # the line through them: engine_seconds at the model's depth
    if per_micro_batch:
        # one more micro-batch of one layer: the layer, both ends (passes above), the engine
        one_more = (0.02 + 0.001 + 0.01) * cfg.trainer.micro_batch_size
        engine.append({"key": {**layout, "grad_accum": 2 * layout["grad_accum"]}, "layers": 1,
                       "seconds": engine[0]["seconds"] + one_more + per_micro_batch})
    me = MachineProfile(device="cpu", model=cpu_info().model, ranks=2, threads_per_rank=1,
                        versions=library_versions())
    save_figures(directory, me, {"passes": passes, "collectives": collectives, "engine": engine,
                                 "optimizer": [{"key": {"numel": n, "tensors": 1},
                                                "seconds": n * 1e-9} for n in (10**6, 10**7)]},
                 "test")


@pytest.mark.parametrize("engine_seconds", [0.02, 1.0])
def test_a_layout_planned_from_another_layouts_engine_run_takes_positive_time(
        tmp_path, engine_seconds):
    """The engine measured at DP2 in far less than its composed parts (a probe whose passes ran
    under load): carried as a fixed cost, that negative residual made TP2's step -0.07 s in a
    bench here. It now scales with the parts; a positive residual is still carried as it is."""
    _tiny_profile(tmp_path, engine_seconds)
    plans = {name: compute_plan(to_object(compose_config(
        [*TINY_FP32, f"plan.profile_dir={tmp_path}",
         *extra]))).compute for name, extra in (("dp2", []), ("tp2", ["parallelism=tp2"]))}
    dp2, tp2 = plans["dp2"], plans["tp2"]
    assert dp2.step_time_s == pytest.approx(engine_seconds)  # the engine's own run, as measured
    assert tp2.step_time_s > 0
    if engine_seconds < 0.5:  # the parts overestimated DP2 by a share; TP2's by the same share
        share = dp2.parts["framework"] / _composed(dp2.parts)
        assert -1 < share < 0
        assert tp2.parts["framework"] == pytest.approx(share * _composed(tp2.parts), rel=0.05)
    else:
        assert tp2.parts["framework"] > 0


def test_a_layout_with_more_micro_batches_pays_the_frameworks_cost_of_each(tmp_path):
    """The probe's engine also runs with twice the micro-batches: what the extra one cost beyond
    its composed passes is the framework's per micro-batch (the schedule, the loader's
    hand-over). A layout planned from that probe with 4 micro-batches a step pays it 3 times
    more than the probed one; the plan had priced every accumulation count alike (micro-batch
    1 x 4 planned as 4 x 1: 37% under its run on the EPYC here)."""
    from launcher.plan.calibrated import engine_key_of

    def planned(directory, *extra):
        return compute_plan(to_object(compose_config(
            [*TINY_FP32, f"plan.profile_dir={directory}", *extra]))).compute

    without, with_cost = tmp_path / "without", tmp_path / "with"
    _tiny_profile(without, 0.2)
    _tiny_profile(with_cost, 0.2, per_micro_batch=0.03)
    cfg = to_object(compose_config(TINY_FP32))
    accum = compute_plan(cfg).batch.grad_accum_steps
    more = [f"trainer.global_batch_size={4 * cfg.trainer.micro_batch_size * 2}"]  # 4 a replica
    assert engine_key_of(cfg, compute_plan(cfg).dims, accum)["grad_accum"] == accum == 1
    base, extra = planned(with_cost, *more), planned(without, *more)
    assert planned(with_cost).step_time_s == pytest.approx(0.2)  # the probed layout: as measured
    assert base.parts["framework"] - extra.parts["framework"] == pytest.approx(3 * 0.03)
    assert base.parts["compute"] == pytest.approx(extra.parts["compute"])


def test_another_zero_stage_of_the_engine_carries_its_framework_cost(tmp_path):
    """A probe of ZeRO-1 planned ZeRO-0 (and DeepSpeed's ZeRO-2/3 from its ZeRO-1 run) with no
    framework cost at all: only a record of the same stage was looked for. The same engine's
    records of another stage stand in now; a record of the same stage still comes first."""
    _tiny_profile(tmp_path, 1.0)
    cfg = to_object(compose_config(TINY_FP32))
    assert cfg.parallelism.zero_stage == 1
    zero0 = compute_plan(to_object(compose_config(
        [*TINY_FP32, f"plan.profile_dir={tmp_path}", "parallelism.zero_stage=0"]))).compute
    assert zero0.parts["framework"] > 0.1, zero0.parts  # 0 before


def _composed(parts: dict) -> float:
    """The step's parts without the framework residual."""
    return sum(v for k, v in parts.items() if k != "framework")


@pytest.mark.parametrize("extra, named", [
    (["parallelism.context_parallel_size=2"], "context parallelism (context_parallel_size=2)"),
])
def test_a_layout_the_probe_cannot_measure_is_labelled_catalogue_not_measured(tmp_path, extra,
                                                                             named):
    """The probe times dense passes at the full sequence: CP2 was composed from them as if it
    were CP1 (compute at the whole sequence, no ring exchange) and labelled "measured". It is
    the catalogue's now, saying why, and plan.calibrate=true does not probe for it."""
    from launcher.cli.probe_first import needs_probe

    _tiny_profile(tmp_path, 0.05)
    base = compute_plan(to_object(compose_config([*TINY_FP32, f"plan.profile_dir={tmp_path}"])))
    assert base.sources["step time"].startswith("measured: ")
    plan = compute_plan(to_object(compose_config(
        [*TINY_FP32, f"plan.profile_dir={tmp_path}", *extra])))
    source = plan.sources["step time"]
    assert source.startswith("catalogue (cpu") and f"the probe does not measure {named}" in source
    assert plan.compute.parts["framework"] == 0.0
    assert not needs_probe(True, source) and needs_probe(True, "catalogue (cpu ...), not "
                                                         "calibrated: python -m launcher.probe")


def test_a_moe_model_is_labelled_catalogue_not_measured():
    from launcher.plan.timing import unprobed

    cfg = to_object(compose_config([*TINY_FP32, "model.num_experts=4", "model.moe_router_topk=2"]))
    assert "mixture-of-experts layers (num_experts=4" in unprobed(cfg, compute_plan(cfg).dims)
    dense = to_object(compose_config(TINY_FP32))
    assert unprobed(dense, compute_plan(dense).dims) == ""
