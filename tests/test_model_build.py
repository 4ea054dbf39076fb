"""Real Megatron-Core GPTModels built from trainwright configs on CPU (gloo): structure follows the
config, forward + backward give a finite loss, recompute replays dropout exactly, and TP=2
reproduces the TP=1 loss with the planned per-rank parameter counts."""

from __future__ import annotations

import math

import pytest

from launcher.config import (
    Arch,
    ModelConfig,
    ParallelismConfig,
    Precision,
    Recompute,
    TrainerConfig,
)

from tests.helpers.dist import gloo_group, run_distributed
from tests.helpers.models import FP32, build, in_process, preset, small


def batch(vocab: int, seq: int, size: int = 2, seed: int = 0):
    """Deterministic token ids and positions."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, seq), generator=gen)
    return ids, torch.arange(seq).expand(size, seq)


def step(gpt, model: ModelConfig, seq: int = 32):
    """One forward + backward; returns the mean loss."""
    ids, pos = batch(model.vocab_size, seq)
    loss = gpt(ids, pos, None, labels=ids).mean()
    loss.backward()
    return loss.item()


@pytest.fixture(scope="module")
def megatron_tp1():
    """A 1-rank gloo group with Megatron's parallel state (TP=PP=1) and CPU redirects."""
    with gloo_group():
        from launcher.engines.model import init_parallel_state

        init_parallel_state(ParallelismConfig(), seed=1234)
        yield


def n_params(gpt) -> int:
    return sum(p.numel() for p in gpt.parameters())


@in_process
def test_tiny_llama_structure_and_step(megatron_tp1):
    import torch

    from launcher.plan.params import count_parameters

    model = preset("tiny")
    gpt = build(model)
    layers = gpt.decoder.layers
    assert len(layers) == model.num_layers
    norms = [m for l in layers for m in (l.input_layernorm, l.pre_mlp_layernorm)]
    assert all(isinstance(m, torch.nn.RMSNorm) for m in norms)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in gpt.modules())
    assert not hasattr(gpt.embedding, "position_embeddings") and gpt.rotary_pos_emb is not None
    assert gpt.output_layer.weight is not None  # untied
    linears = [m for l in layers for m in (l.self_attention.linear_qkv, l.mlp.linear_fc1)]
    assert all(m.bias is None for m in linears)
    assert gpt.embedding.word_embeddings.weight.shape[0] == 4096
    assert n_params(gpt) == count_parameters(model).total
    loss = step(gpt, model, seq=64)
    assert math.isfinite(loss) and abs(loss - math.log(4096)) < 1.0
    assert all(p.grad is not None for p in gpt.parameters())


@in_process
def test_gpt2_style_tied_learned_positions_biases(megatron_tp1):
    import torch

    from launcher.plan.params import count_parameters

    model = small(arch=Arch.gpt2, untie_embeddings_and_output_weights=False, add_bias_linear=True,
                  hidden_dropout=0.1, attention_dropout=0.1)
    gpt = build(model)
    layer = gpt.decoder.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.LayerNorm)
    assert not any(isinstance(m, torch.nn.RMSNorm) for m in gpt.modules())
    assert gpt.embedding.position_embeddings.weight.shape == (model.seq_length, model.hidden_size)
    assert gpt.output_layer.weight is None  # tied: logits use the word embedding
    assert gpt.shared_embedding_or_output_weight() is gpt.embedding.word_embeddings.weight
    assert layer.self_attention.linear_qkv.bias is not None
    assert layer.mlp.linear_fc1.bias is not None
    assert layer.mlp.linear_fc1.weight.shape[0] == model.ffn_hidden_size  # GELU, not gated
    assert gpt.embedding.word_embeddings.weight.shape[0] == 1024  # 1000 padded to 128
    assert n_params(gpt) == count_parameters(model).total
    assert math.isfinite(step(gpt, model))


@in_process
def test_grouped_query_attention_shapes(megatron_tp1):
    model = small(num_attention_heads=8, num_query_groups=2, kv_channels=16)
    gpt = build(model)
    attn = gpt.decoder.layers[0].self_attention
    assert attn.linear_qkv.weight.shape == ((8 + 2 * 2) * 16, 64)
    assert attn.linear_proj.weight.shape == (64, 8 * 16)
    assert gpt.decoder.layers[0].mlp.linear_fc1.weight.shape[0] == 2 * model.ffn_hidden_size
    assert math.isfinite(step(gpt, model))


@in_process
def test_tiny_moe_routes_to_experts(megatron_tp1):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from launcher.plan.params import count_parameters

    model = small(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96)
    gpt = build(model)
    mlp = gpt.decoder.layers[0].mlp
    assert isinstance(mlp, MoELayer)
    assert mlp.router.weight.shape == (4, 64)
    assert len(mlp.experts.local_experts) == 4
    assert mlp.experts.local_experts[0].linear_fc1.weight.shape == (2 * 96, 64)
    assert n_params(gpt) == count_parameters(model).total
    assert math.isfinite(step(gpt, model))
    assert mlp.router.weight.grad is not None and mlp.router.weight.grad.abs().sum() > 0


@in_process
@pytest.mark.parametrize("recompute", [Recompute.selective, Recompute.full])
def test_recompute_replays_dropout_exactly(megatron_tp1, recompute):
    model = small(hidden_dropout=0.2, attention_dropout=0.2)
    results = []
    for mode in (Recompute.none, recompute):
        trainer = TrainerConfig(precision=Precision.fp32, activation_recompute=mode)
        gpt = build(model, trainer=trainer)
        loss = step(gpt, model)
        results.append((loss, [p.grad.clone() for p in gpt.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b
    assert all((a == b).all() for a, b in zip(grads_a, grads_b))


@in_process
def test_compat_redirects_and_deepspeed_mpu(megatron_tp1):
    import os

    import torch

    from launcher.engines.deepspeed.mpu import DeepSpeedMPU

    from launcher.engines import compat

    first, again = compat.install(), compat.install()
    assert first == again and "device='cuda' to CPU mode" in first  # idempotent
    assert compat.cpu_mode_active()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros([], device="cuda").device.type == "cpu"
    x = torch.ones(2)
    assert x.cuda() is x and x.to("cuda").device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor" and x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    mpu = DeepSpeedMPU()
    assert (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()) == (0, 1)
    assert (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()) == (0, 1)
    assert mpu.get_tensor_model_parallel_world_size() == 1
    assert mpu.get_data_parallel_group_ranks() == [0]


def test_transformer_config_translation():
    import torch

    from launcher.engines.model import transformer_config

    model = small(num_experts=4, moe_capacity_factor=0.0, num_query_groups=0)
    par = ParallelismConfig(
        tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=True
    )
    cfg = transformer_config(model, par, TrainerConfig(precision=Precision.bf16,
                                                       activation_recompute=Recompute.full))
    assert cfg.params_dtype == torch.bfloat16 and cfg.bf16 and not cfg.fp16
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.sequence_parallel and cfg.pipeline_dtype == torch.bfloat16
    recompute = (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers)
    assert recompute == ("full", "uniform", 1)
    assert cfg.num_query_groups == 4 and cfg.kv_channels == 16
    assert cfg.num_moe_experts == 4 and cfg.moe_ffn_hidden_size == 128
    assert cfg.moe_expert_capacity_factor is None and cfg.normalization == "RMSNorm"


def test_padded_vocab_size():
    from launcher.shape.model import padded_vocab_size

    assert padded_vocab_size(4096, 128, 1) == 4096
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432


def rng_draws() -> dict:
    """One draw from the model-parallel stream and one from the default stream (state restored)."""
    import torch
    from megatron.core import tensor_parallel

    state = torch.get_rng_state()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(1).item()
    default_draw = torch.rand(1).item()
    torch.set_rng_state(state)
    return dict(tp_draw=tp_draw, default_draw=default_draw)


def tp_worker(args: dict) -> dict:
    """Per rank: loss, parameter count and RNG draws of one model at TP=1, TP=2 and TP=2 + SP."""
    from megatron.core import parallel_state

    from launcher.engines.model import build_gpt_model, init_parallel_state
    from launcher.shape.dims import ParallelDims
    from launcher.plan.params import stage_params

    model = small(**args["model"])
    out = {}
    layouts = {
        "tp1": ParallelismConfig(),
        "tp2": ParallelismConfig(tensor_parallel_size=2),
        "tp2sp": ParallelismConfig(tensor_parallel_size=2, sequence_parallel=True),
    }
    for name, par in layouts.items():
        init_parallel_state(par, seed=args["seed"])
        out[name] = rng_draws()
        gpt = build_gpt_model(model, par, FP32)
        out[name].update(loss=step(gpt, model), numel=n_params(gpt),
                         planned=stage_params(model, ParallelDims.build(par, world=2),
                                              first=True, last=True).total)
        parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_tensor_parallel_2_matches_tp1():
    model = dict(num_query_groups=2, hidden_dropout=0.0, attention_dropout=0.0)
    ranks = run_distributed("tests.test_model_build:tp_worker", 2, {"seed": 7, "model": model})
    for rank in ranks:
        assert rank["tp1"]["numel"] == rank["tp1"]["planned"]
        for name in ("tp2", "tp2sp"):
            assert rank[name]["numel"] == rank[name]["planned"] < rank["tp1"]["numel"]
            assert abs(rank[name]["loss"] - rank["tp1"]["loss"]) < 1e-5, (name, rank)
    assert ranks[0]["tp2"]["numel"] == ranks[1]["tp2"]["numel"]
    # Dropout inside TP regions differs per TP rank; the default (data-parallel) stream does not.
    assert ranks[0]["tp2"]["tp_draw"] != ranks[1]["tp2"]["tp_draw"]
    assert ranks[0]["tp1"]["tp_draw"] == ranks[1]["tp1"]["tp_draw"]
    assert ranks[0]["tp2"]["default_draw"] == ranks[1]["tp2"]["default_draw"]


def _plan_of(*overrides):
    from launcher.compose import compose_config, to_object
    from launcher.plan import compute_plan

    from launcher.config import Precision
    from launcher.plan.precision import with_precision

    cfg = to_object(compose_config(["model=llama3_1b", "cluster=local_gpu", *overrides]))
    plan = compute_plan(cfg)
    return with_precision(cfg, Precision(plan.precision)), plan  # as the job resolves it


def test_gpu_without_transformer_engine_replans_with_unfused_attention():
    """A GPU plan counts flash attention for `auto`; without TE Megatron-Core runs unfused
    attention, so the re-plan stores the scores (and is refused when that no longer fits)."""
    from launcher.config import AttentionBackend
    from launcher.engines.model import runnable_attention
    from launcher.plan import PlanError, compute_plan

    cfg, plan = _plan_of("model.seq_length=2048", "trainer.micro_batch_size=2")
    assert plan.memory.flash_attention
    trainer, note = runnable_attention(cfg.trainer, planned_flash=True, gpu=True, te=False)
    assert trainer.attention_backend == AttentionBackend.unfused and "Transformer Engine" in note
    replanned = compute_plan(type(cfg)(**{**cfg.__dict__, "trainer": trainer}))
    assert not replanned.memory.flash_attention
    scores = 16 * 32 * 2048 ** 2 * 2 * (4 + 2)  # layers x heads x s^2 x b x bytes per score
    grown = replanned.memory.per_gpu.activations - plan.memory.per_gpu.activations
    log_sum_exp = 16 * 2048 * 2 * 32 * 4  # what flash keeps instead (fp32 per row and head)
    logits_fp32 = 2048 * 2 * 128_256 * 4  # Megatron-Core's loss instead of TE's keeps them
    assert trainer.cross_entropy_fusion.value == "native"
    assert grown == scores - log_sum_exp + logits_fp32
    for gpu, te in ((True, True), (False, False)):
        assert runnable_attention(cfg.trainer, planned_flash=True, gpu=gpu, te=te) == \
            (cfg.trainer, None)
    big, _ = _plan_of("model.seq_length=2048", "trainer.micro_batch_size=4")
    trainer, _ = runnable_attention(big.trainer, planned_flash=True, gpu=True, te=False)
    with pytest.raises(PlanError, match="exceeds the H100"):
        compute_plan(type(big)(**{**big.__dict__, "trainer": trainer}))


def test_explicit_flash_without_transformer_engine_is_refused():
    from launcher.engines.model import KernelUnavailable, runnable_attention

    cfg, _ = _plan_of("trainer.attention_backend=flash", "trainer.micro_batch_size=1")
    with pytest.raises(KernelUnavailable, match="trainer.attention_backend=unfused"):
        runnable_attention(cfg.trainer, planned_flash=True, gpu=True, te=False)


def test_loss_fusion_follows_device_precision_and_transformer_engine():
    """auto: TE's fused cross-entropy on a GPU in bf16 with TE, Megatron-Core's without, off on
    CPU and for fp32 (the fused kernels return bf16 gradients); te without TE is refused."""
    import dataclasses

    from launcher.config import CrossEntropyFusion
    from launcher.engines.model import KernelUnavailable, cross_entropy_fields

    cfg, _ = _plan_of()
    bf16 = cfg.trainer
    fp32 = dataclasses.replace(bf16, precision=Precision.fp32)
    fused = {"cross_entropy_loss_fusion": True}
    assert cross_entropy_fields(bf16, gpu=True, te=True) == {**fused,
                                                            "cross_entropy_fusion_impl": "te"}
    assert cross_entropy_fields(bf16, gpu=True, te=False) == {
        **fused, "cross_entropy_fusion_impl": "native"}
    off = {"cross_entropy_loss_fusion": False}
    assert cross_entropy_fields(bf16, gpu=False, te=False) == off
    assert cross_entropy_fields(fp32, gpu=True, te=True) == off
    te = dataclasses.replace(bf16, cross_entropy_fusion=CrossEntropyFusion.te)
    with pytest.raises(KernelUnavailable, match="trainer.cross_entropy_fusion=native"):
        cross_entropy_fields(te, gpu=True, te=False)
    # a GPU process without TE replans bf16's auto as native; fp32's auto stays (it runs off)
    from launcher.engines.model import runnable_attention

    replanned, _ = runnable_attention(bf16, planned_flash=False, gpu=True, te=False)
    assert replanned.cross_entropy_fusion == CrossEntropyFusion.native
    assert runnable_attention(fp32, planned_flash=False, gpu=True, te=False) == (fp32, None)


def test_plan_keeps_no_fp32_logits_with_transformer_engines_loss():
    """On a GPU in bf16 the plan counts TE's fused loss (auto): the last stage's activations
    are smaller than with the loss unfused by exactly the fp32 logits of a micro-batch."""
    _, auto = _plan_of("model.seq_length=2048", "trainer.micro_batch_size=2")
    _, unfused = _plan_of("model.seq_length=2048", "trainer.micro_batch_size=2",
                          "trainer.cross_entropy_fusion=off")
    diff = unfused.memory.per_gpu.activations - auto.memory.per_gpu.activations
    assert diff == 2048 * 2 * 128_256 * 4


def test_fused_loss_with_fp32_is_a_config_error():
    from launcher.compose import compose_config, to_object
    from launcher.plan import PlanError, compute_plan

    cfg = to_object(compose_config(["trainer.precision=fp32", "trainer.cross_entropy_fusion=native"]))
    with pytest.raises(PlanError, match=r"cross_entropy_fusion=native needs trainer.precision=bf16"):
        compute_plan(cfg)


@in_process
def test_megatron_cores_fused_loss_equals_the_unfused_one_in_bf16(megatron_tp1):
    """trainer.cross_entropy_fusion=native through the model (bf16, CPU): the loss within 1e-3
    and the logits' gradients (through the output layer) within bf16 rounding."""
    import torch

    from launcher.config import CrossEntropyFusion

    model = small(vocab_size=512)
    losses, grads = {}, {}
    for choice in (CrossEntropyFusion.native, CrossEntropyFusion.off):
        trainer = TrainerConfig(precision=Precision.bf16, cross_entropy_fusion=choice)
        gpt = build(model, trainer=trainer)
        assert gpt.config.cross_entropy_loss_fusion == (choice == CrossEntropyFusion.native)
        ids, pos = batch(model.vocab_size, 32)
        loss = gpt(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        losses[choice] = loss.item()
        grads[choice] = gpt.output_layer.weight.grad.float()
    assert abs(losses[CrossEntropyFusion.native] - losses[CrossEntropyFusion.off]) < 1e-3
    diff = (grads[CrossEntropyFusion.native] - grads[CrossEntropyFusion.off]).abs().max()
    assert diff <= 0.02 * grads[CrossEntropyFusion.off].abs().max()
