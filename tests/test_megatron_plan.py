"""Engine choice in the plan: which engine a layout needs (engine_notes) and the rules that
reject DeepSpeed for layouts only Megatron-Core runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.compose import compose_config, to_object
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.plan import PlanError, compute_plan
from launcher.plan.__main__ import main

EXP_70B = "experiment=llama3_70b_16k_h100"


def plan_of(*overrides, world_size=None):
    return compute_plan(to_object(compose_config(list(overrides))), world_size)


def test_70b_16k_plan_says_megatron_works_and_what_deepspeed_would_not():
    notes = plan_of(EXP_70B).engine_notes
    assert notes[0].startswith("engine=megatron") and "(works)" in notes[0]
    assert "distributed optimizer (ZeRO-1)" in notes[0] and "1F1B" in notes[0]
    deepspeed = [n for n in notes if n.startswith("engine=deepspeed would not work")]
    assert any("pipeline_parallel_size=4" in n and "does not pipeline" in n for n in deepspeed)
    assert any("zero_stage=2 or 3 with pipeline_parallel_size=4" in n for n in deepspeed)


def test_70b_plan_json_and_table_carry_the_engine_notes(capsys):
    out = subprocess.run([sys.executable, "-m", "launcher.plan", EXP_70B, "plan.format=json"],
                         capture_output=True, text=True, check=True).stdout
    notes = json.loads(out)["engine_notes"]
    assert notes and "engine=megatron" in notes[0]
    assert main([EXP_70B]) == 0
    table = capsys.readouterr().out
    assert "engine choice" in table and "does not pipeline" in table


def test_plain_deepspeed_layout_notes_megatron_alternative_only_when_needed():
    notes = plan_of("parallelism.zero_stage=2").engine_notes
    assert notes[0].startswith("engine=deepspeed: ZeRO stage 2 around the Megatron-Core GPTModel")
    assert "1.22x the step of engine=megatron" in notes[0] and notes[0].endswith("(works)")
    assert notes[1:] == ("engine=megatron would not work: zero_stage=2: Megatron-Core shards "
                         "optimizer state only (distributed optimizer = ZeRO-1)",)
    with pytest.raises(PlanError) as info:  # DeepSpeed with pipeline stages is refused
        plan_of("parallelism=pp2")
    assert "use engine=megatron" in str(info.value)
    vpp = plan_of("engine=megatron", "parallelism=pp2",
                  "parallelism.virtual_pipeline_parallel_size=2", "model.num_layers=4")
    assert "interleaved 1F1B" in vpp.engine_notes[0]
    assert any("virtual_pipeline_parallel_size=2" in n for n in vpp.engine_notes[1:])


@pytest.mark.parametrize("overrides,fragments", [
    (["parallelism=pp2", "parallelism.virtual_pipeline_parallel_size=2", "model.num_layers=4"],
     ["parallelism.virtual_pipeline_parallel_size=2 is not supported by engine=deepspeed",
      "use engine=megatron"]),
    (["parallelism.context_parallel_size=2"],
     ["parallelism.context_parallel_size=2 is not supported by engine=deepspeed",
      "use engine=megatron"]),
    (["model.num_experts=4", "parallelism.expert_parallel_size=2"],
     ["parallelism.expert_parallel_size=2 is not supported by engine=deepspeed"]),
    (["parallelism.pipeline_parallel_size=2", "parallelism.zero_stage=3"],
     ["pipeline_parallel_size=2 with zero_stage=3 needs engine=megatron with the distributed "
      "optimizer"]),
])
def test_deepspeed_rejects_megatron_only_layouts_with_a_fix(overrides, fragments, capsys):
    assert main(overrides) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_the_same_layouts_plan_on_megatron():
    for overrides in (["parallelism.context_parallel_size=2"],
                      ["model.num_experts=4", "parallelism.expert_parallel_size=2"],
                      ["parallelism=pp2", "parallelism.virtual_pipeline_parallel_size=2",
                       "model.num_layers=4"]):
        plan = plan_of("engine=megatron", *overrides)
        assert plan.engine == "megatron" and "(works)" in plan.engine_notes[0]


def test_mixtral_preset_plans_on_megatron_with_expert_parallelism():
    plan = plan_of("model=mixtral_8x7b", "engine=megatron", "cluster=slurm_h100",
                   "cluster.nodes=8", "parallelism.tensor_parallel_size=2",
                   "parallelism.expert_parallel_size=8", "parallelism.pipeline_parallel_size=4",
                   "trainer.activation_recompute=full", "trainer.micro_batch_size=1",
                   "model.num_layers=32")
    assert plan.dims.ep == 8 and "(works)" in plan.engine_notes[0]
