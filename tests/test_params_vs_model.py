"""The plan's parameter counts equal sum(p.numel()) of the Megatron-Core GPTModel built from the
same config: whole model on one rank by component, and per GPU under TP=2 and PP=2."""

from __future__ import annotations

import pytest

from launcher.compose import compose_config, to_object
from launcher.params import count_parameters, stage_params

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=160",
         "model.num_attention_heads=4", "model.vocab_size=1000", "model.seq_length=32",
         "trainer.precision=fp32"]
CASES = {
    "llama_gqa": SMALL + ["model.num_query_groups=2"],
    "llama_tied_qkv_bias": SMALL + ["model.untie_embeddings_and_output_weights=false",
                                    "model.add_qkv_bias=true", "model.kv_channels=32"],
    "gpt2": SMALL + ["model.arch=gpt2", "model.untie_embeddings_and_output_weights=false",
                     "model.add_bias_linear=true", "model.max_position_embeddings=48"],
    "moe": SMALL + ["model.num_experts=4", "model.moe_router_topk=2",
                    "model.moe_ffn_hidden_size=96", "model.num_query_groups=2"],
    "moe_bias": SMALL + ["model.num_experts=4", "model.add_bias_linear=true"],
}


def _component(name: str) -> str:
    leaf = name.rsplit(".", 2)
    if "norm" in leaf[-2] or "layer_norm" in leaf[-1]:
        return "norms"
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output_layer"
    return "attention" if ".self_attention." in name else "mlp"


def built_counts(model) -> dict:
    counts = {"embedding": 0, "attention": 0, "mlp": 0, "norms": 0, "output_layer": 0}
    for name, param in model.named_parameters():
        counts[_component(name)] += param.numel()
    return counts


def _cfg(overrides):
    return to_object(compose_config(overrides))


@pytest.fixture(scope="module")
def one_rank():
    from tests._dist import gloo_group
    from launcher.model import init_parallel_state
    from megatron.core import parallel_state

    with gloo_group():
        init_parallel_state(_cfg([]).parallelism)
        yield
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("case", sorted(CASES))
def test_counts_equal_built_model_by_component(case, one_rank):
    from launcher.model import build_gpt_model

    cfg = _cfg(CASES[case])
    model = build_gpt_model(model=cfg.model, parallelism=cfg.parallelism, trainer=cfg.trainer)
    built = built_counts(model)
    expected = count_parameters(cfg.model)
    assert built == {k: getattr(expected, k) for k in built}, case
    assert sum(p.numel() for p in model.parameters()) == expected.total
    one_stage = stage_params(cfg.model, cfg.parallelism, first=True, last=True)
    assert one_stage.total == expected.total


LAYOUTS = {
    "tp2": ["parallelism.tensor_parallel_size=2", "parallelism.sequence_parallel=true"],
    "pp2": ["parallelism.pipeline_parallel_size=2"],
}


def per_rank_worker(args: dict) -> dict:
    """On each of 2 ranks: build every case under every layout, return this rank's counts."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from launcher.model import build_gpt_model, init_parallel_state

    out = {}
    for layout, extra in LAYOUTS.items():
        for case in args["cases"]:
            cfg = _cfg(CASES[case] + extra)
            init_parallel_state(cfg.parallelism)
            model = build_gpt_model(
                model=cfg.model, parallelism=cfg.parallelism, trainer=cfg.trainer,
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage())
            out[f"{layout}/{case}"] = sum(p.numel() for p in model.parameters())
            parallel_state.destroy_model_parallel()
    out["rank"] = dist.get_rank()
    return out


@pytest.mark.slow
def test_per_gpu_counts_equal_built_shards_tp2_pp2():
    from tests._dist import run_distributed

    cases = ["llama_gqa", "llama_tied_qkv_bias", "gpt2"]
    results = run_distributed("tests.test_params_vs_model:per_rank_worker", 2, {"cases": cases})
    for layout, extra in LAYOUTS.items():
        for case in cases:
            cfg = _cfg(CASES[case] + extra)
            for rank, result in enumerate(results):
                pp = cfg.parallelism.pipeline_parallel_size
                first = pp == 1 or rank == 0
                last = pp == 1 or rank == pp - 1
                expected = stage_params(cfg.model, cfg.parallelism, first, last).total
                assert result[f"{layout}/{case}"] == expected, (layout, case, rank)
