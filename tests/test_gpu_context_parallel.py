"""Context parallelism (engine=megatron, Transformer Engine attention) on a CUDA GPU.

Megatron-Core implements CP only in Transformer Engine's attention, and TE needs CUDA, so this
module skips at import time without a GPU or without ``transformer_engine``. Two ranks are used;
on a one-GPU machine they share the card (``tests.helpers.dist`` gives each rank its own NCCL host
id).

Checks: CP=2 (each rank holds half of every sequence, split in the load-balanced 2 x CP chunks)
reproduces the CP=1 loss and gradient norm of the first step on the same weights and data (bf16,
so within bf16 rounding, not bitwise), the loss falls over a few steps at CP=2, and CP ranks
report the same loss.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine", reason="context parallelism needs Transformer Engine")

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CP_MODEL = ["engine=megatron", "model.num_layers=2", "model.hidden_size=256",
            "model.ffn_hidden_size=512", "model.num_attention_heads=4",
            "model.num_query_groups=2", "model.vocab_size=1024", "model.seq_length=512",
            "trainer.precision=bf16", "trainer.micro_batch_size=2",
            "trainer.global_batch_size=4", "optimizer.warmup_steps=0", "optimizer.lr=3e-3",
            "parallelism.zero_stage=0", "trainer.attention_backend=auto"]
STEPS = 4


def cp_worker(args: dict) -> dict:
    """Train ``STEPS`` steps at the given CP size on fixed data; per-step loss and grad norm."""
    from launcher.core.phases import PhaseTimer
    from tests.helpers.engines import build, fixed_batches

    cfg, plan, eng = build(CP_MODEL + [f"parallelism.context_parallel_size={args['cp']}"])
    next_batch = fixed_batches(cfg.model.vocab_size, cfg.model.seq_length,
                               cfg.trainer.micro_batch_size, 7)
    out = {"loss": [], "grad_norm": [], "seq_per_rank": eng.seq_length,
           "micro_batches": plan.batch.grad_accum_steps}
    for _ in range(STEPS):
        result = eng.train_step(next_batch, 3e-3, PhaseTimer())
        out["loss"].append(result.loss)
        out["grad_norm"].append(result.grad_norm)
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    from tests.helpers.dist import run_distributed

    return {cp: run_distributed("tests.test_gpu_context_parallel:cp_worker", cp, {"cp": cp},
                                timeout=600, backend="nccl")
            for cp in (1, 2)}


def test_cp2_first_step_equals_cp1(runs):
    cp1, cp2 = runs[1][0], runs[2][0]
    assert cp2["seq_per_rank"] == cp1["seq_per_rank"] // 2 == 256
    assert cp1["micro_batches"] == cp2["micro_batches"] == 2
    assert abs(cp2["loss"][0] - cp1["loss"][0]) < 2e-3 * cp1["loss"][0], (cp1, cp2)
    assert abs(cp2["grad_norm"][0] - cp1["grad_norm"][0]) < 2e-2 * cp1["grad_norm"][0]


def test_cp_ranks_agree_and_loss_falls(runs):
    r0, r1 = runs[2]
    assert r0["loss"] == r1["loss"]
    assert r0["loss"][-1] < r0["loss"][0] - 0.2, r0["loss"]
