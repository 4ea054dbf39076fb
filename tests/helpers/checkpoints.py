"""Checkpoint stand-ins: ``record`` gives the records a CheckpointManager stores with a step
(architecture, layout, training) for a small model and layout (``MODEL``, ``PLAN``) with changes,
and ``FakeIO`` is an engine checkpoint IO writing one small torch file or failing on read.

Formerly in tests/test_resume_safety.py; tests/test_train_checkpoint.py uses them too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from launcher.runtime import resume as rs

MODEL = {"name": "t", "arch": "llama", "num_layers": 2, "hidden_size": 64,
         "ffn_hidden_size": 128, "num_attention_heads": 8, "num_query_groups": 4,
         "vocab_size": 512, "seq_length": 64}
PLAN = {"engine": "deepspeed", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
        "virtual_pipeline_parallel_size": 1, "context_parallel_size": 1,
        "expert_parallel_size": 1, "data_parallel_size": 2, "zero_stage": 1, "world_size": 2,
        "global_batch_size": 8, "micro_batch_size": 2, "grad_accum_steps": 2, "seq_length": 64,
        "train_steps": 20}


def record(model=None, plan=None) -> dict:
    plan = {**PLAN, **(plan or {})}
    return {"architecture": rs.architecture({**MODEL, **(model or {})}),
            "layout": rs.layout(plan), "training": rs.training(plan)}


class FakeIO:
    """An engine checkpoint IO writing one ``bytes``-sized torch file, or failing on read."""

    def __init__(self, size: int = 1000, read_error: BaseException = None):
        self.size, self.read_error = size, read_error

    def prepare_read(self) -> None:
        pass

    def write(self, step_dir: Path, *, background: bool) -> bool:
        step_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.zeros(self.size // 4, dtype=torch.float32)},
                   step_dir / "model.pt")
        return False

    def finish_background(self, blocking: bool) -> bool:
        return True

    def read(self, step_dir: Path) -> None:
        if self.read_error is not None:
            raise self.read_error
