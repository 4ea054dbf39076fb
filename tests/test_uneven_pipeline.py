"""Uneven pipeline stages (issue 13, part 0): parallelism.layers_in_first_stage /
layers_in_last_stage and account_for_embedding/loss_in_pipeline_split, in the plan (layers,
parameters and memory per stage), its validation (every factor, the fix, exit 2) and
engine=megatron: real models built on 2 and 3 gloo ranks hold exactly the plan's parameters per
stage, train, and a checkpoint saved with an uneven split loads into an even one."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.compose import compose_config, to_object
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.plan import PlanError, compute_plan
from launcher.plan.__main__ import main
from launcher.plan.params import stage_params
from launcher.shape.dims import ParallelDims
from launcher.shape.stages import StageSplit, split_problems, stage_layers

# its module-scoped runs are made once: every test of the module on one xdist worker
pytestmark = pytest.mark.xdist_group("uneven_pipeline")

L405 = ["model=llama3_405b", "cluster=slurm_h100", "cluster.nodes=2048", "engine=megatron",
        "parallelism.tensor_parallel_size=8", "parallelism.pipeline_parallel_size=16",
        "parallelism.sequence_parallel=true", "trainer.micro_batch_size=1",
        "trainer.global_batch_size=2048", "trainer.activation_recompute=full"]
FIRST_LAST_7 = ["parallelism.layers_in_first_stage=7", "parallelism.layers_in_last_stage=7"]
ACCOUNTED = ["parallelism.account_for_embedding_in_pipeline_split=true",
             "parallelism.account_for_loss_in_pipeline_split=true"]


def plan_of(*overrides, world_size=None):
    return compute_plan(to_object(compose_config(list(overrides))), world_size)


def _derived(*overrides):
    """The plan, also when only its memory check refused it."""
    try:
        return plan_of(*overrides)
    except PlanError as exc:
        assert exc.plan is not None, exc
        return exc.plan


def test_405b_at_pp16_is_refused_even_with_both_uneven_fixes(capsys):
    assert main(L405) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "model.num_layers=126 is not divisible by pipeline_parallel_size x " \
           "virtual_pipeline_parallel_size = 16 x 1 = 16" in err
    assert "parallelism.layers_in_first_stage=7 parallelism.layers_in_last_stage=7 " \
           "(7 + 14 x 8 + 7 = 126)" in err
    assert "account_for_embedding_in_pipeline_split=true" in err


@pytest.mark.parametrize("split", ["first_last", "accounted"])
def test_405b_llama3_layout_plans_with_fewer_layers_on_the_ends(split):
    """Meta's layout (Llama 3 paper, 3.3.2): 126 layers on 16 stages, one layer fewer on the
    first and the last stage; both ways of saying it give 7 + 14 x 8 + 7."""
    p = plan_of(*L405, *(FIRST_LAST_7 if split == "first_last" else ACCOUNTED))
    assert p.stage_layers == (7,) + (8,) * 14 + (7,)
    assert p.dims.layers_per_stage(p.model.layers) == 8
    d = p.dims
    first, middle, last = (stage_params(to_object(compose_config(L405)).model, d, f, la)
                           for f, la in ((True, False), (False, False), (False, True)))
    assert middle.dense > first.dense - first.largest_layer  # the embedding replaces a layer
    assert p.params.per_gpu == max(first.total, middle.total, last.total)
    assert p.memory.per_gpu.stage in ("first", "middle", "last")


def test_accounted_split_allows_virtual_stages():
    """(126 + 2) / 16 = 8 per stage, so VPP 2 and 4 divide it; first/last 7 do not."""
    p = plan_of(*L405, *ACCOUNTED, "parallelism.virtual_pipeline_parallel_size=4")
    assert p.stage_layers == (7,) + (8,) * 14 + (7,)
    with pytest.raises(PlanError) as info:
        plan_of(*L405, *FIRST_LAST_7, "parallelism.virtual_pipeline_parallel_size=2")
    assert "stage layer counts 7 (parallelism.layers_in_first_stage=7, layers_in_last_stage=7, " \
           "8 per middle stage) are not divisible by virtual_pipeline_parallel_size=2" \
           in str(info.value)


@pytest.mark.parametrize("layers,pp,split,expected", [
    (4, 2, StageSplit(first=1), (1, 3)),
    (4, 2, StageSplit(last=1), (3, 1)),
    (4, 3, StageSplit(first=1, last=1), (1, 2, 1)),
    (5, 2, StageSplit(embedding=True), (2, 3)),
    (6, 2, StageSplit(embedding=True, loss=True), (3, 3)),
    (30, 4, StageSplit(first=6), (6, 8, 8, 8)),
])
def test_stage_layers_follow_megatron_core(layers, pp, split, expected):
    assert split_problems(layers, pp, 1, split) == []
    assert stage_layers(layers, pp, split) == expected


@pytest.mark.parametrize("overrides,texts", [
    (["parallelism.layers_in_first_stage=100", "parallelism.layers_in_last_stage=30"],
     ["leave -4 of model.num_layers=126 layers for 14 other stage(s)"]),
    (["parallelism.layers_in_first_stage=6", "parallelism.layers_in_last_stage=7"],
     ["model.num_layers=126 minus parallelism.layers_in_first_stage=6, layers_in_last_stage=7 "
      "leaves 113 layers, not divisible by the 14 middle stages (pipeline_parallel_size=16 "
      "minus 2)"]),
    (FIRST_LAST_7 + ["parallelism.account_for_loss_in_pipeline_split=true"],
     ["cannot be combined with account_for_embedding_in_pipeline_split"]),
    (["parallelism.account_for_embedding_in_pipeline_split=true"],
     ["model.num_layers + embedding = 126 + 1 = 127 is not divisible by pipeline_parallel_size "
      "x virtual_pipeline_parallel_size = 16 x 1 = 16"]),
    (FIRST_LAST_7 + ["parallelism.pipeline_parallel_size=1", "parallelism.tensor_parallel_size=8"],
     ["needs pipeline_parallel_size > 1 (got 1)"]),
])
def test_bad_splits_exit_2_naming_every_factor(overrides, texts, capsys):
    assert main(L405 + overrides) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    for text in texts:
        assert text in err, err


def test_deepspeed_refuses_uneven_stages(capsys):
    assert main(["engine=deepspeed", "parallelism.layers_in_first_stage=1"]) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "parallelism.layers_in_first_stage=1 needs engine=megatron" in err


def test_fewer_layers_on_the_first_stage_lower_its_memory():
    """Under 1F1B the first stage holds PP micro-batches in flight; one layer fewer there moves
    the most loaded stage to the second one (8 layers, PP - 1 in flight)."""
    even_ok = ["model.num_layers=128"]  # 8 per stage
    even = _derived(*L405, *even_ok, "trainer.activation_recompute=none")
    uneven = _derived(*L405, *FIRST_LAST_7, "trainer.activation_recompute=none")
    assert even.memory.per_gpu.stage == "first"
    assert uneven.memory.per_gpu.activations < even.memory.per_gpu.activations


# --- real models on gloo ranks ------------------------------------------------------------

SMALL = ["engine=megatron", "model.hidden_size=64", "model.ffn_hidden_size=160",
         "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=512",
         "model.seq_length=32", "trainer.precision=fp32", "trainer.micro_batch_size=1",
         "trainer.global_batch_size=4", "engine.optimizer_checkpoint=fully_reshardable"]
CASES = {  # name: (ranks, overrides)
    "pp2_first1": (2, ["model.num_layers=4", "parallelism.pipeline_parallel_size=2",
                       "parallelism.layers_in_first_stage=1"]),
    "pp2_embedding": (2, ["model.num_layers=5", "parallelism.pipeline_parallel_size=2",
                          "parallelism.account_for_embedding_in_pipeline_split=true"]),
    "pp3_ends1": (3, ["model.num_layers=4", "parallelism.pipeline_parallel_size=3",
                      "parallelism.layers_in_first_stage=1", "parallelism.layers_in_last_stage=1"]),
}


RELOAD = {  # case saved with an uneven split -> the split that loads it
    "pp2_first1": ["model.num_layers=4", "parallelism.pipeline_parallel_size=2"],  # 2 + 2
    "pp2_embedding": ["model.num_layers=5", "parallelism.pipeline_parallel_size=2",
                      "parallelism.layers_in_last_stage=1"],  # 4 + 1 (saved as 2 + 3)
}


def _cfg(overrides):
    return to_object(compose_config(SMALL + overrides))


def _counts(chunks) -> dict:
    from megatron.core import parallel_state as ps

    return {"dense": sum(p.numel() for c in chunks for p in c.parameters()),
            "layers": [layer.layer_number for c in chunks for layer in c.decoder.layers],
            "first": ps.is_pipeline_first_stage(ignore_virtual=True),
            "last": ps.is_pipeline_last_stage(ignore_virtual=True)}


def uneven_worker(args: dict) -> dict:
    """Build the case's chunks; then train a step with the uneven split, save, and (RELOAD
    cases) load the checkpoint into another split and evaluate both."""
    from megatron.core import parallel_state as ps

    from launcher.engines.megatron.engine import build_model_chunks
    from launcher.engines.model import init_parallel_state
    from tests.helpers.megatron_checkpoints import _batches, _finish, _load, _save, _steps, build

    name = args["case"]
    cfg = _cfg(CASES[name][1])
    init_parallel_state(cfg.parallelism)
    out = {"built": _counts(build_model_chunks(cfg.model, cfg.parallelism, cfg.trainer))}
    ps.destroy_model_parallel()
    ckpt = Path(args["dir"]) / name / "checkpoints"
    cfg, plan, eng = build(SMALL + CASES[name][1])
    batches = _batches(cfg, 6)
    out["train"] = _steps(eng, cfg, plan, batches[:4], 1)
    _save(eng, ckpt, 1, background=False)
    out["eval"] = eng.eval_loss(batches[4:6])
    _finish()
    if name in RELOAD:
        cfg, plan, eng = build(SMALL + RELOAD[name])
        _load(eng, ckpt)
        out["even_eval"] = eng.eval_loss(batches[4:6])
        _finish()
        out["per_rank_format_refusal"] = _per_rank_format_refusal(name, Path(args["dir"]))
        out["unrecorded_refusal"] = _per_rank_format_refusal(name, Path(args["dir"]), False)
    return out


def _per_rank_format_refusal(name: str, root: Path, recorded: bool = True) -> str:
    """The error of loading the default per-rank optimizer format (dp_reshardable), saved with
    the case's split, into the RELOAD split (same PP: only the layers per stage differ);
    ``recorded=False``: a checkpoint saved without the buffer-layout record (as before it was
    written), so only Megatron-Core's own load can find the difference."""
    from launcher.core.errors import CheckpointError
    from tests.helpers.megatron_checkpoints import _batches, _finish, _load, _save, _steps, build

    ckpt = root / f"{name}_per_rank_{recorded}" / "checkpoints"
    per_rank = [o for o in SMALL if "optimizer_checkpoint" not in o]
    cfg, plan, eng = build(per_rank + CASES[name][1])
    _steps(eng, cfg, plan, _batches(cfg, 4), 1)
    if not recorded:
        eng.checkpoint_io.buffers = None
    _save(eng, ckpt, 1, background=False)
    _finish()
    cfg, plan, eng = build(per_rank + RELOAD[name])
    try:
        _load(eng, ckpt)
        return ""
    except CheckpointError as exc:
        return f"exit {exc.exit_code}: {exc}"
    finally:
        _finish()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from tests.helpers.dist import run_distributed

    root = tmp_path_factory.mktemp("uneven")
    return {name: run_distributed("tests.test_uneven_pipeline:uneven_worker", ranks,
                                  {"case": name, "dir": str(root)})
            for name, (ranks, _) in CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_built_stages_hold_the_plans_layers_and_parameters(name, built):
    ranks, overrides = CASES[name]
    cfg = _cfg(overrides)
    dims = ParallelDims.build(cfg.parallelism, ranks)
    layers = dims.stage_layers(cfg.model.num_layers)
    offset = 0
    for rank, result in enumerate(built[name]):
        got = result["built"]
        assert (got["first"], got["last"]) == (rank == 0, rank == ranks - 1)
        assert got["layers"] == list(range(offset + 1, offset + layers[rank] + 1)), (name, rank)
        offset += layers[rank]
        assert got["dense"] == stage_params(cfg.model, dims, got["first"], got["last"],
                                            layers[rank]).dense, (name, rank)
    assert offset == cfg.model.num_layers
    plan = compute_plan(cfg, world_size=ranks)
    assert plan.params.per_gpu == max(r["built"]["dense"] for r in built[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RELOAD))
def test_uneven_checkpoint_loads_into_another_split(name, built):
    """dist-checkpointing keys layers by their global number, so the weights saved by an
    uneven split (1 + 3, 2 + 3) evaluate to the same loss in another one (2 + 2, 4 + 1)."""
    import math

    for result in built[name]:
        assert all(math.isfinite(loss) for loss, _ in result["train"])
        assert result["even_eval"] == pytest.approx(result["eval"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RELOAD))
def test_per_rank_optimizer_format_refuses_another_split_naming_the_conversion(name, built):
    """The default format saves the distributed optimizer's flat buffers, whose layout follows
    the stage split: another split at the same PP is refused (exit 2) before any tensor is read
    (Megatron-Core failed with "Global shape mismatch ... bucket_idx_0.param")."""
    split = {"pp2_first1": "saved [1, 3], now [2, 2]",
             "pp2_embedding": "saved [2, 3], now [4, 1]"}
    for result in built[name]:
        message = result["per_rank_format_refusal"]
        assert message.startswith("exit 2: "), message
        assert f"layers per pipeline stage: {split[name]}" in message, message
        assert "python -m launcher.convert reshard checkpoint=" in message
        assert "Global shape mismatch" not in message


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RELOAD))
def test_per_rank_checkpoint_without_the_layout_record_is_refused_not_crashed(name, built):
    """Written without the buffer-layout record: Megatron-Core's shape error on the flat buffers
    becomes the same refusal (exit 2, the conversion command), not a crash of every rank."""
    for result in built[name]:
        message = result["unrecorded_refusal"]
        assert message.startswith("exit 2: "), message
        assert "laid out differently from this run's" in message, message
        assert "bucket_idx_0.param" in message
        assert "python -m launcher.convert reshard checkpoint=" in message
