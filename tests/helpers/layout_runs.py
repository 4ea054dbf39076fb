"""One training step of the same 4-layer model at every layout, shared by the tests that hold
layouts against each other: the first-step loss and gradient norm (tests/test_seeded_init.py)
and the downstream task scores of the checkpoint at its end (tests/test_eval_tasks.py).

The learning rate is 1e-12 (Adam's first update moves a weight by about that, far below an fp32
weight's last bit), so the scores at the end are those of the initial weights, which
``trainer.layout_invariant_init`` makes the same at every layout; the first step's loss and
gradients are computed before any update. The runs are a session fixture: tests that use it
carry :data:`LAYOUT_GROUP`, so that one xdist worker trains them once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.data_prep import train_hf_tokenizer
from tests.helpers.training import train

LAYOUT_GROUP = pytest.mark.xdist_group("layout_runs")
ONE_STEP = ["engine=megatron", "model.num_layers=4", "trainer.train_steps=1",
            "trainer.global_batch_size=8", "trainer.eval_interval=0", "optimizer.lr=1e-12",
            "optimizer.min_lr=0", "optimizer.warmup_steps=0", "optimizer.weight_decay=0",
            "eval.tasks=[tw_facts,tw_paragraphs]", "eval.limit=8",
            "eval.pack_length=64"]  # the rows packed several to a sequence (evals/rows.py)
MOE = ["model.num_experts=4", "model.moe_router_topk=2"]
LAYOUTS = {
    "pp1": [],
    "pp2": ["parallelism.pipeline_parallel_size=2"],
    "tp2": ["parallelism.tensor_parallel_size=2"],
    "pp2_vpp2": ["parallelism.pipeline_parallel_size=2",
                 "parallelism.virtual_pipeline_parallel_size=2"],
    "deepspeed": ["engine=deepspeed"],
    "moe_ep1": MOE,
    "moe_ep2": [*MOE, "parallelism.expert_parallel_size=2"],
}
"""Two ranks each; VPP: 2 chunks of 1 layer per stage, and 4 micro-batches a step (the
interleaved schedule needs at least PP of them)."""


def _read(run_dir: Path, console: str) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [scores] = [r for r in rows if any(k.startswith("eval/tw_") for k in r)]
    return {"first": next(r for r in rows if r.get("step") == 1 and "loss" in r),
            "scores": {k: v for k, v in scores.items() if k.startswith("eval/tw_")},
            "console": console}


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory) -> dict:
    """name -> {"first": the step-1 metrics line, "scores": the eval/tw_* metrics,
    "console": the run's output}."""
    tmp = tmp_path_factory.mktemp("layout_runs")
    tokenizer = train_hf_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=500)
    runs = {}
    for name, overrides in LAYOUTS.items():
        proc = train(tmp, name, *ONE_STEP, f"eval.tokenizer={tokenizer}", *overrides)
        runs[name] = _read(tmp / name, proc.stdout + proc.stderr)
    return runs
