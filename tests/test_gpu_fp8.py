"""FP8 training and the fused cross-entropy on a CUDA GPU, through ``python -m launcher.train``.

Skips at import without CUDA, without Transformer Engine, or on a GPU without FP8 tensor cores
(compute capability below 8.9). Two ranks share the GPU (DP=2, engine=megatron, distributed
optimizer), the tiny model of tests/test_gpu_layouts.py on mock data, 6 steps:

- bf16, FP8 with the delayed and the tensorwise recipe, and FP8 with FP8 weights
  (``trainer.fp8.param_gather``): every step's loss finite, FP8's first loss within 1% of
  bf16's (same weights: the layout-invariant init), the last within 3%, and the loss falls;
- the fused cross-entropy (``trainer.cross_entropy_fusion=te``) against the unfused one: the
  first step's loss within 1e-3 (relative).

``bash bench/device/run_gpu_tests.sh tests/test_gpu_fp8.py`` runs it on the device machine.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine", reason="FP8 runs through Transformer Engine")
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs FP8 tensor cores (compute capability 8.9+)", allow_module_level=True)

from tests.helpers.gpu import DP2, MEGATRON, train  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

RUN = MEGATRON + DP2 + ["parallelism.zero_stage=1"]
FP8 = ["trainer.precision=fp8"]


def losses(run_dir) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fp8")
    named = {
        "bf16": RUN,
        "delayed": RUN + FP8,
        "tensorwise": RUN + FP8 + ["trainer.fp8.recipe=tensorwise"],
        "fp8_weights": RUN + FP8 + ["trainer.fp8.recipe=tensorwise",
                                    "trainer.fp8.param_gather=true",
                                    "trainer.layout_invariant_init=false"],
        "loss_off": RUN + ["trainer.cross_entropy_fusion=off"],
        "loss_te": RUN + ["trainer.cross_entropy_fusion=te"],
    }
    return {name: losses(train(tmp, name, *overrides)) for name, overrides in named.items()}


@pytest.mark.parametrize("name", ["delayed", "tensorwise"])
def test_fp8_loss_follows_bf16(runs, name):
    bf16, fp8 = runs["bf16"], runs[name]
    assert len(fp8) == len(bf16) == 6 and all(math.isfinite(x) for x in fp8), fp8
    assert abs(fp8[0] / bf16[0] - 1) < 0.01, (fp8, bf16)
    assert abs(fp8[-1] / bf16[-1] - 1) < 0.03, (fp8, bf16)
    assert fp8[-1] < fp8[0] - 0.3


def test_fp8_weights_train(runs):
    loss = runs["fp8_weights"]
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0] - 0.3, loss


def test_fused_cross_entropy_equals_unfused(runs):
    off, te = runs["loss_off"], runs["loss_te"]
    assert abs(te[0] / off[0] - 1) < 1e-3, (te, off)
    assert abs(te[-1] / off[-1] - 1) < 0.02, (te, off)
