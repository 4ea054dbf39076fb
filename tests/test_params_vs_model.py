"""The plan's parameter counts equal sum(p.numel()) of the Megatron-Core GPTModel built from the
same config: whole model on one rank by component, and per GPU (summed over a rank's virtual
pipeline chunks) under TP=2, PP=2, PP=2 x VPP=2 and EP=2. The plan's weight, gradient and
optimizer bytes per GPU equal what engine=megatron allocates (up to its documented padding)."""

from __future__ import annotations

import pytest

from launcher.compose import compose_config, to_object
from launcher.plan import compute_plan
from launcher.plan.params import count_parameters, layer_params, stage_params
from launcher.shape.dims import ParallelDims
from launcher.shape.model import ResolvedModel

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=160",
         "model.num_attention_heads=4", "model.vocab_size=1000", "model.seq_length=32",
         "trainer.precision=fp32"]
CASES = {
    "llama_gqa": SMALL + ["model.num_query_groups=2"],
    "llama_tied_qkv_bias": SMALL + ["model.untie_embeddings_and_output_weights=false",
                                    "model.add_qkv_bias=true", "model.kv_channels=32"],
    "llama_qk_norm": SMALL + ["model.qk_layernorm=true", "model.kv_channels=32",
                              "model.num_query_groups=2"],
    "gpt2": SMALL + ["model.arch=gpt2", "model.untie_embeddings_and_output_weights=false",
                     "model.add_bias_linear=true", "model.max_position_embeddings=48"],
    "moe": SMALL + ["model.num_experts=4", "model.moe_router_topk=2",
                    "model.moe_ffn_hidden_size=96", "model.num_query_groups=2"],
    "moe_bias": SMALL + ["model.num_experts=4", "model.add_bias_linear=true"],
    "olmo2": SMALL + ["model.qk_layernorm=true", "model.qk_layernorm_all_heads=true",
                      "model.norm_placement=post", "model.num_query_groups=2"],
    "gemma3": SMALL + ["model.qk_layernorm=true", "model.norm_placement=pre_post",
                       "model.norm_zero_centered=true", "model.scale_embeddings=true",
                       "model.activation=gelu_tanh", "model.num_query_groups=2",
                       "model.window_size=8", "model.full_attention_every=2",
                       "model.rotary_base_local=10000",
                       "model.untie_embeddings_and_output_weights=false"],
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
    from launcher.plan.precision import resolve_precision

    return resolve_precision(to_object(compose_config(overrides)))  # as a job resolves auto


@pytest.fixture(scope="module")
def one_rank():
    from tests.helpers.dist import gloo_group
    from launcher.engines.model import init_parallel_state
    from megatron.core import parallel_state

    with gloo_group():
        init_parallel_state(_cfg([]).parallelism)
        yield
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("case", sorted(CASES))
def test_counts_equal_built_model_by_component(case, one_rank):
    from launcher.engines.model import build_gpt_model

    cfg = _cfg(CASES[case])
    model = build_gpt_model(model=cfg.model, parallelism=cfg.parallelism, trainer=cfg.trainer)
    built = built_counts(model)
    expected = count_parameters(cfg.model)
    assert built == {k: getattr(expected, k) for k in built}, case
    assert sum(p.numel() for p in model.parameters()) == expected.total
    one_rank_dims = ParallelDims.build(cfg.parallelism, world=1)
    one_stage = stage_params(cfg.model, one_rank_dims, first=True, last=True)
    assert one_stage.total == expected.total


@pytest.mark.parametrize("preset", ["mixtral_8x7b", "llama3_8b"])
def test_full_size_preset_built_on_meta_device_equals_plan(preset, one_rank):
    """The presets themselves, built by Megatron-Core with every tensor on the meta device (no
    memory): Mixtral 8x7B's 46,702,792,704 parameters (8 experts, top-2) by component."""
    import torch

    from launcher.engines.model import build_gpt_model

    cfg = _cfg([f"model={preset}", "engine=megatron"])
    with torch.device("meta"):
        model = build_gpt_model(model=cfg.model, parallelism=cfg.parallelism, trainer=cfg.trainer)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    expected = count_parameters(cfg.model)
    assert built_counts(model) == {k: getattr(expected, k) for k in built_counts(model)}
    assert sum(p.numel() for p in model.parameters()) == expected.total
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    if cfg.model.num_experts:  # the plan's inactive share is (experts - top-k) of them
        e, k = cfg.model.num_experts, cfg.model.moe_router_topk
        assert experts == (expected.total - expected.active_per_token) * e // (e - k)
        assert experts == 32 * 8 * 3 * 4096 * 14336  # layers x experts x SwiGLU matrices
    else:
        assert experts == 0


DENSE = ["llama_gqa", "llama_tied_qkv_bias", "gpt2"]
MOE_CASES = ["moe", "moe_bias"]
PP2 = ["parallelism.pipeline_parallel_size=2"]
LAYOUTS = {  # name: (overrides, cases); 2 ranks each
    # Megatron-Core refuses MoE biases with expert tensor parallelism (ETP = TP) > 1.
    "tp2": (["parallelism.tensor_parallel_size=2", "parallelism.sequence_parallel=true"],
            DENSE + ["moe", "olmo2", "gemma3"]),
    "pp2": (PP2, DENSE + MOE_CASES),
    "pp2_vpp2": (PP2 + ["parallelism.virtual_pipeline_parallel_size=2", "model.num_layers=4"],
                 DENSE + ["moe"]),
    "ep2": (["parallelism.expert_parallel_size=2"], MOE_CASES),
}


def _layout_cfg(layout: str, case: str):
    return _cfg(CASES[case] + LAYOUTS[layout][0] + ["engine=megatron"])


def _chunk_counts(chunk) -> dict:
    """Parameters of one model chunk: dense vs expert (inside ``mlp.experts``; Megatron-Core reduces
    them over the expert-data-parallel group, which is the dense DP group when EP=1), the
    embedding/output tables and the global layer numbers."""
    out = {"dense": 0, "expert": 0, "embedding": 0, "output_layer": 0,
           "layers": [layer.layer_number for layer in chunk.decoder.layers]}
    for name, param in chunk.named_parameters():
        out["expert" if ".mlp.experts." in name else "dense"] += param.numel()
        for part in ("embedding", "output_layer"):
            if name.startswith(part + "."):
                out[part] += param.numel()
    return out


def per_rank_worker(args: dict) -> dict:
    """On each of 2 ranks: build this rank's model chunks (as engine=megatron does) for every
    layout and case; return the counts per chunk and the rank's pipeline position."""
    from megatron.core import parallel_state as ps

    from launcher.engines.megatron.engine import build_model_chunks
    from launcher.engines.model import init_parallel_state

    out = {}
    for layout, (_, cases) in LAYOUTS.items():
        for case in cases:
            cfg = _layout_cfg(layout, case)
            init_parallel_state(cfg.parallelism)
            chunks = build_model_chunks(cfg.model, cfg.parallelism, cfg.trainer)
            out[f"{layout}/{case}"] = {
                "chunks": [_chunk_counts(c) for c in chunks],
                "first": ps.is_pipeline_first_stage(ignore_virtual=True),
                "last": ps.is_pipeline_last_stage(ignore_virtual=True)}
            ps.destroy_model_parallel()
    out["memory"] = memory_worker(args)
    return out


@pytest.fixture(scope="module")
def ranks():
    """One 2-process launch: counts of every layout and the memory measurements."""
    from tests.helpers.dist import run_distributed

    return run_distributed("tests.test_params_vs_model:per_rank_worker", 2, {})


def _rank_sum(result: dict, key: str) -> int:
    return sum(chunk[key] for chunk in result["chunks"])


@pytest.mark.xdist_group("params_per_rank")  # its module fixture, built once
@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_per_gpu_counts_equal_built_shards(layout, ranks):
    """Per rank, dense and expert parameters summed over the rank's model chunks equal the plan's
    stage numbers; the plan's params_per_gpu is the most loaded rank."""
    for case in LAYOUTS[layout][1]:
        cfg = _layout_cfg(layout, case)
        pp = cfg.parallelism.pipeline_parallel_size
        totals = []
        for rank, result in enumerate(ranks):
            got = result[f"{layout}/{case}"]
            assert (got["first"], got["last"]) == (pp == 1 or rank == 0, pp == 1 or rank == 1)
            dims = ParallelDims.build(cfg.parallelism, world=2)
            expected = stage_params(cfg.model, dims, got["first"], got["last"])
            assert _rank_sum(got, "dense") == expected.dense, (layout, case, rank)
            assert _rank_sum(got, "expert") == expected.expert, (layout, case, rank)
            totals.append(_rank_sum(got, "dense") + _rank_sum(got, "expert"))
        assert compute_plan(cfg, world_size=2).params.per_gpu == max(totals), (layout, case)


@pytest.mark.xdist_group("params_per_rank")  # its module fixture, built once
@pytest.mark.slow
def test_vpp_chunks_hold_embedding_first_and_output_layer_last(ranks):
    """PP=2 x VPP=2, 4 layers: rank 0 holds virtual stages 0 and 2 (layers 1 and 3), rank 1 holds
    1 and 3; the embedding is on rank 0's first chunk, the output layer (its own copy when tied)
    on rank 1's last chunk, so the ranks together hold the plan's total plus the tied copy."""
    for case in LAYOUTS["pp2_vpp2"][1]:
        cfg = _layout_cfg("pp2_vpp2", case)
        d = ResolvedModel.of(cfg.model)
        word = d.padded_vocab * d.hidden
        first, last = (r[f"pp2_vpp2/{case}"]["chunks"] for r in ranks)
        assert [c["layers"] for c in first] == [[1], [3]], case
        assert [c["layers"] for c in last] == [[2], [4]], case
        assert [c["embedding"] for c in first] == [word + d.positions * d.hidden, 0], case
        assert [c["output_layer"] for c in first + last] == [0, 0, 0, word], case
        held = sum(c["dense"] + c["expert"] for c in first + last)
        assert held == count_parameters(cfg.model).total + (word if d.tied else 0), case


@pytest.mark.xdist_group("params_per_rank")  # its module fixture, built once
@pytest.mark.slow
def test_ep2_splits_the_experts_and_replicates_the_rest(ranks):
    """EP=2, 4 experts top-2: each rank holds 2 experts per layer and every dense parameter;
    dense + the experts of both ranks = the plan's total."""
    for case in MOE_CASES:
        cfg = _layout_cfg("ep2", case)
        d = ResolvedModel.of(cfg.model)
        one_expert = layer_params(d).experts // d.experts
        r0, r1 = (r[f"ep2/{case}"] for r in ranks)
        assert _rank_sum(r0, "dense") == _rank_sum(r1, "dense"), case
        assert _rank_sum(r0, "expert") == _rank_sum(r1, "expert") == d.layers * 2 * one_expert
        total = _rank_sum(r0, "dense") + _rank_sum(r0, "expert") + _rank_sum(r1, "expert")
        assert total == compute_plan(cfg, world_size=2).params.total, case


# Training state measured on engine=megatron after one step, bf16 (2-byte weights, fp32 grads,
# fp32 master copy + Adam moments): EP=2 with the distributed optimizer (dense state sharded over
# DP=2, experts over expert-DP=1) and PP=2 with tied embeddings and plain DDP.
MEMORY = {
    "ep2_distopt": CASES["moe"] + ["parallelism.expert_parallel_size=2",
                                   "parallelism.zero_stage=1"],
    "pp2_ddp": CASES["llama_tied_qkv_bias"] + PP2 + ["parallelism.zero_stage=0"],
}
MEMORY_COMMON = ["engine=megatron", "trainer.precision=bf16", "trainer.micro_batch_size=2",
                 "trainer.global_batch_size=4"]


def _bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _optimizer_bytes(optimizer, model_params: list) -> int:
    """Adam moments plus fp32 master parameters (those that are not the model's own tensors)."""
    own = {p.data_ptr() for p in model_params}
    total = 0
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                total += 0 if param.data_ptr() in own else _bytes(param)
                state = sub.optimizer.state.get(param, {})
                total += sum(_bytes(state[k]) for k in ("exp_avg", "exp_avg_sq") if k in state)
    return total


def measure_state(eng) -> dict:
    """Bytes of this rank's parameters, their gradients (main_grad views and the DDP buffers that
    hold them) and optimizer state; ``padding``: buffer elements no parameter occupies."""
    from megatron.core.utils import unwrap_model

    params = [p for chunk in eng.chunks for p in unwrap_model(chunk).parameters()]
    buffers = [b for chunk in eng.chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    return {"weights": sum(_bytes(p) for p in params),
            "grads": sum(_bytes(p.main_grad) for p in params),
            "grad_buffer": sum(_bytes(b.grad_data) for b in buffers),
            "padding": sum(b.numel for b in buffers) - sum(p.numel() for p in params),
            "tensors": len(params), "buckets": sum(len(b.buckets) for b in buffers),
            "optimizer": _optimizer_bytes(eng.optimizer, params),
            "stage": _stage_name()}


def _stage_name() -> str:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return "all"
    return "first" if ps.is_pipeline_first_stage(ignore_virtual=True) else "last"


def memory_worker(args: dict) -> dict:
    """Build each MEMORY engine, take one step (so the optimizer state exists), measure."""
    import torch
    from megatron.core import parallel_state as ps

    from launcher.engines import engine_inputs, spec
    from launcher.engines.model import init_parallel_state
    from launcher.core.phases import PhaseTimer
    from tests.helpers.engines import fixed_batches

    out = {}
    for name, overrides in MEMORY.items():
        cfg = _cfg(overrides + MEMORY_COMMON)
        plan = compute_plan(cfg, world_size=torch.distributed.get_world_size())
        init_parallel_state(cfg.parallelism, seed=cfg.trainer.seed)
        eng = spec(cfg.engine.name).build(batch=plan.batch, model=cfg.model, **engine_inputs(cfg))
        eng.train_step(fixed_batches(cfg.model.vocab_size, cfg.model.seq_length,
                                     cfg.trainer.micro_batch_size, 0), 1e-3, PhaseTimer())
        out[name] = measure_state(eng)
        ps.destroy_model_parallel()
    return out


@pytest.mark.xdist_group("params_per_rank")  # its module fixture, built once
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MEMORY))
def test_plan_state_bytes_equal_the_built_engine(name, ranks):
    """The plan's weights and grads per GPU are the bytes of the most loaded rank's parameters and
    main_grads exactly; its optimizer bytes are exact summed over the ranks that shard them (per
    rank the distributed optimizer's shards differ by at most the buffer padding). DDP buffers
    exceed the grads only by Megatron's distributed-optimizer padding: parameter starts aligned
    to 64 elements, buckets to lcm(DP, 128)."""
    mem = compute_plan(_cfg(MEMORY[name] + MEMORY_COMMON), world_size=2).memory.per_gpu
    measured = [r["memory"][name] for r in ranks]
    loaded = [m for m in measured if m["stage"] == mem.stage]
    assert loaded, (mem.stage, measured)
    for m in loaded:
        assert (m["weights"], m["grads"]) == (mem.weights, mem.grads), (m, mem)
        assert abs(m["optimizer"] - mem.optimizer) <= 12 * m["padding"], (m, mem)
    if mem.stage == "all":
        assert sum(m["optimizer"] for m in measured) == 2 * mem.optimizer, (measured, mem)
    for m in measured:
        assert 0 <= m["padding"] < 64 * m["tensors"] + 128 * m["buckets"], m
        assert m["grad_buffer"] == m["grads"] + 4 * m["padding"], m
