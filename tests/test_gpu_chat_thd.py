"""Packed conversation rows through Transformer Engine's attention (THD, cu_seqlens) on a GPU.

On CPU, chat rows keep their conversations apart with an explicit attention mask in
Megatron-Core's local attention (tests/test_chat_training.py). Under TE the engine sends them as
one packed THD sequence per micro-batch (launcher/engines/packed_rows.py). This module
needs a CUDA GPU and ``transformer_engine`` and skips at import time without them.

Checks, in bf16 (TE's fused and flash attention take no fp32; its unfused attention takes no
THD):
- a conversation packed after another gives its logits alone (to bf16 rounding);
- evaluation's scored rows packed several to a sequence score as they do alone;
- one training step at DP2, TP2 with sequence parallelism, PP2 and CP2 (conversations padded to
  multiples of 4 and split into 4 chunks) gives the loss and
  gradient norm of Megatron-Core's local attention on the rows' explicit mask
  (TRAINWRIGHT_DISABLE_TE=1), on the same rows and initial weights: within 2e-3 and 2e-2, as
  tests/test_gpu_context_parallel.py holds CP to CP=1.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine", reason="the THD path is Transformer Engine's")

from tests.helpers.chat import split_rows, write_chat_shards  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_a_conversation_packed_after_another_gives_its_logits_alone_in_thd():
    from launcher.config import ParallelismConfig, Precision, TrainerConfig
    from launcher.engines.packed_rows import params_on, to_thd
    from launcher.engines.model import init_parallel_state
    from launcher.runtime.chat_data import packed_sample
    from tests.helpers.dist import gloo_group
    from tests.helpers.models import build, small

    with gloo_group():  # one rank: no collective in a TP1 forward
        init_parallel_state(ParallelismConfig(), seed=1234)
        bf16 = TrainerConfig(precision=Precision.bf16)
        gpt = build(small(seq_length=48, vocab_size=512), trainer=bf16).cuda().bfloat16().eval()
        rng = np.random.default_rng(0)
        a, b = rng.integers(0, 512, 17), rng.integers(0, 512, 23)
        ones = lambda n: np.r_[0, np.ones(n - 1)].astype(np.uint8)  # noqa: E731
        packed = packed_sample(np.r_[a, b], np.r_[ones(17), ones(23)],
                               np.r_[np.zeros(17, int), np.ones(23, int)], 48, pad_id=0)
        alone = packed_sample(b, ones(23), np.zeros(23, int), 48, pad_id=0)
        logits = []
        for sample in (packed, alone):
            flat, params = to_thd({k: v[None] for k, v in sample.items()})
            with torch.no_grad():
                logits.append(gpt(flat["tokens"].cuda(), flat["position_ids"].cuda(), None,
                                  packed_seq_params=params_on(params, torch.device("cuda")))
                              .float().cpu()[0])
        np.testing.assert_allclose(logits[0][17:40].numpy(), logits[1][:23].numpy(),
                                   rtol=2e-2, atol=2e-2)


def test_scored_rows_packed_in_thd_score_as_they_do_alone():
    """Evaluation's packed rows (launcher/evals/rows.py) through the Megatron scoring path under
    TE: THD sequences, each row's summed log-probability as alone in its sequence (bf16)."""
    from launcher.config import ParallelismConfig, Precision, TrainerConfig
    from launcher.engines.model import init_parallel_state
    from tests.helpers.dist import gloo_group
    from tests.helpers.models import build, small
    from tests.helpers.scoring import score_packed_and_alone

    with gloo_group():
        init_parallel_state(ParallelismConfig(), seed=1234)
        bf16 = TrainerConfig(precision=Precision.bf16)
        gpt = build(small(seq_length=48, vocab_size=512), trainer=bf16).cuda().bfloat16().eval()
        packed, alone, plan = score_packed_and_alone(gpt, torch.device("cuda"), seq=48,
                                                     vocab=512, pack=48)
    assert max(len(q) for step in plan for q in step.replicas[0]) >= 3
    for row, (logprob, _) in alone.items():
        assert packed[row][0] == pytest.approx(logprob, rel=2e-2, abs=5e-2), row


def _first_step(tmp_path, name: str, *overrides: str, te: bool) -> dict:
    from tests.helpers import gpu

    run = gpu.train(tmp_path, name, *overrides, env={} if te else {"TRAINWRIGHT_DISABLE_TE": "1"})
    [line] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return line


def test_thd_steps_equal_the_masked_path_at_tp2_sp_pp2_and_cp2(tmp_path):
    """Two ranks sharing the GPU (tests/helpers/gpu.py); the masked path at DP2 is the
    reference (the per-token loss is the same however the batch is split: CPU tests)."""
    data = write_chat_shards(tmp_path / "data", split_rows())
    # the rows' conversations (6-19 tokens, up to 3 a row) fit 64 tokens rounded up to 4, as
    # data_prep chat.pack_multiple=4 packs them for CP=2; the plan reads it from the manifest
    (data / "manifest.json").write_text(json.dumps({"format": "chat",
                                                    "chat": {"pack_multiple": 4}}))
    common = ["engine=megatron", "model.seq_length=64", "trainer.train_steps=1",
              "trainer.global_batch_size=8", "model.hidden_dropout=0",
              "model.attention_dropout=0", f"hydra.searchpath=[file://{data / 'conf'}]",
              "data=chat"]
    base = _first_step(tmp_path, "masked", *common, te=False)
    for name, layout in {"thd_dp2": [],
                         "thd_tp2_sp": ["parallelism.tensor_parallel_size=2",
                                        "parallelism.sequence_parallel=true"],
                         "thd_pp2": ["parallelism.pipeline_parallel_size=2"],
                         "thd_cp2": ["parallelism.context_parallel_size=2"]}.items():
        got = _first_step(tmp_path, name, *common, *layout, te=True)
        assert got["loss"] == pytest.approx(base["loss"], rel=2e-3), name
        assert got["grad_norm"] == pytest.approx(base["grad_norm"], rel=2e-2), name
        assert got["target_tokens"] == base["target_tokens"], name
