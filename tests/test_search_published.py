"""Published layouts against the search and the step-time model (issue 13, part 3).

Sources (figures used only where we are confident of them):

* Llama 3 405B, "The Llama 3 Herd of Models" (Meta, 2024), Table 4, 16M-token batches on H100:
  8,192 GPUs TP 8 CP 1 PP 16 DP 64 seq 8,192 -> 430 TFLOP/s per GPU (43% BF16 MFU);
  16,384 GPUs TP 8 CP 1 PP 16 DP 128 seq 8,192 -> 400 TFLOP/s (40-41%);
  16,384 GPUs TP 8 CP 16 PP 16 DP 8 seq 131,072 -> 380 TFLOP/s (38%) (DP = 16,384 / (8 x 16 x
  16) = 8; the issue's "DP=4" does not multiply out). Section 3.3.2: one layer fewer on the
  first and the last of the 16 stages, and an interleaved schedule (VPP not published).
* NVIDIA NeMo / Megatron-Bridge H100 performance recipes: Llama 3 8B on 8 H100, TP 1 PP 1 CP 2,
  GBS 128, MBS 1, seq 8,192; Llama 3 70B on 64 H100, TP 4 PP 4 CP 2 (VP 5), seq 8,192 (NeMo
  24.07 performance summary, GBS 128; Megatron-Bridge's ``llama3_70b_pretrain_64gpu_h100_bf16``,
  GBS 256). Their published throughput is FP8, so only the layouts are compared here.

What the model reaches, and why:

* Ranking: the 70B and 8B recipes' TP x PP x CP is the search's first choice. For 405B the
  published TP 8 x PP 16 is the first choice, but with CP 2: in trainwright's memory model (0.3%
  off on a measured H100) Meta's CP 1 layout holds 78-82 GiB of activations and state per GPU
  without recompute, over the 72 GiB that search.headroom=0.10 allows, so it needs full
  recompute (MFU ~28%); CP 2 halves the activations instead. Meta's own stack is not ours.
* MFU: the published layouts (uneven 7 + 14 x 8 + 7 stages, VPP 4, no recompute, the memory check
  set aside) are predicted within 15% of the published TFLOP/s: 8K GPUs -3%, 16K GPUs -8%,
  128K tokens -12% (there compared in causal-attention FLOPs: at 131,072 tokens counting the full
  score matrix, as our MFU does, would inflate the attention FLOPs by 40%; Meta does not say
  which it counts). The model does not overlap TP communication (Megatron-Core's default), which
  Meta's stack may do: the main reason it is low.
"""

from __future__ import annotations

import pytest

from launcher.compose import compose_config, to_object
from launcher.plan import PlanError, compute_plan
from launcher.search.search import search

TOLERANCE = 0.15
"""Relative difference allowed between predicted and published TFLOP/s per GPU."""
L405 = ["model=llama3_405b", "cluster=slurm_h100", "engine=megatron",
        "trainer.micro_batch_size=1"]
META = {  # name: (overrides, published TFLOP/s per GPU, (TP, PP, CP))
    "8k_gpus": (["cluster.nodes=1024", "trainer.global_batch_size=2048"], 430, (8, 16, 1)),
    "16k_gpus": (["cluster.nodes=2048", "trainer.global_batch_size=2048"], 400, (8, 16, 1)),
    "16k_gpus_128k_tokens": (["cluster.nodes=2048", "model.seq_length=131072",
                              "trainer.global_batch_size=128"], 380, (8, 16, 16)),
}
PUBLISHED_405B = ["parallelism.account_for_embedding_in_pipeline_split=true",
                  "parallelism.account_for_loss_in_pipeline_split=true",
                  "parallelism.virtual_pipeline_parallel_size=4",
                  "parallelism.sequence_parallel=true", "trainer.activation_recompute=none"]


def cfg_of(*overrides):
    return to_object(compose_config(list(overrides)))


def _plan(*overrides):
    """The plan, also when only its memory check refuses it (the time model is independent)."""
    try:
        return compute_plan(cfg_of(*overrides))
    except PlanError as exc:
        assert exc.plan is not None, exc
        return exc.plan


def _causal_share(p) -> float:
    """Model FLOPs with causal attention (half the score matrix) over those counted in MFU."""
    d = p.dims
    scores = 3 * 4 * p.batch.seq_length * 16384 * 126  # train FLOPs per token of QK^T and scores x V
    return (p.compute.flops_per_token - scores / 2) / p.compute.flops_per_token if d.cp > 1 else 1.0


@pytest.mark.parametrize("name", sorted(META))
def test_meta_405b_throughput_within_tolerance(name):
    overrides, published, (tp, pp, cp) = META[name]
    p = _plan(*L405, *overrides, *PUBLISHED_405B, f"parallelism.tensor_parallel_size={tp}",
              f"parallelism.pipeline_parallel_size={pp}", f"parallelism.context_parallel_size={cp}")
    assert p.stage_layers == (7,) + (8,) * 14 + (7,)
    tflops = p.compute.flops_per_step * _causal_share(p) / (p.dims.world * p.compute.step_time_s) / 1e12
    assert tflops == pytest.approx(published, rel=TOLERANCE), (name, tflops)


@pytest.mark.parametrize("name", ["8k_gpus", "16k_gpus"])
def test_meta_405b_tp8_pp16_is_the_first_choice(name):
    overrides, _, _ = META[name]
    result = search(cfg_of(*L405, *overrides))
    best = result.ranked[0].candidate
    assert (best.tp, best.pp) == (8, 16), best
    assert best.split.uneven  # 126 layers on 16 stages
    published = [i for i, s in enumerate(result.ranked)
                 if (s.candidate.tp, s.candidate.pp, s.candidate.cp) == (8, 16, 1)]
    assert published and result.ranked[published[0]].candidate.recompute.value == "full"


def test_meta_405b_long_context_needs_tp8_and_cp_of_16_or_more():
    overrides, _, _ = META["16k_gpus_128k_tokens"]
    result = search(cfg_of(*L405, *overrides))
    top = [s.candidate for s in result.ranked[:5]]
    assert all(c.tp == 8 and c.cp >= 16 for c in top), top
    assert any(c.pp == 16 for c in top)


def test_nemo_70b_64_h100_layout_is_the_first_choice():
    result = search(cfg_of("experiment=llama3_70b_16k_h100", "cluster.nodes=8",
                           "trainer.global_batch_size=128"))
    best = result.ranked[0].candidate
    assert (best.tp, best.pp, best.cp) == (4, 4, 2), best
    assert best.vpp > 1


def test_nemo_8b_8_h100_layout_is_the_first_choice():
    """With bf16 gradient reduction (engine.grad_reduce_in_fp32=false); with fp32 gradients
    the 8B state alone (6 bytes x 8 B) leaves too little room at CP 2 without recompute."""
    result = search(cfg_of("experiment=llama3_8b_1x8_h100", "trainer.global_batch_size=128",
                           "engine.grad_reduce_in_fp32=false"))
    best = result.ranked[0].candidate
    assert (best.tp, best.pp, best.cp) == (1, 1, 2), best
