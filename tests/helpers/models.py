"""Megatron-Core GPTModels built in-process from trainwright configs (fp32 by default): a
conf/model preset (``preset``), a 2-layer model (``small``), the model itself (``build``, every
stream seeded as init_parallel_state seeds them), and ``in_process``, the xdist group of the tests
that build models in the pytest process.

Formerly in tests/test_model_build.py; tests/test_seeded_init.py uses them too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.config import ModelConfig, ParallelismConfig, Precision, TrainerConfig

CONF = Path(__file__).resolve().parents[2] / "conf"
FP32 = TrainerConfig(precision=Precision.fp32)
in_process = pytest.mark.xdist_group(name="megatron_model_build")


def preset(name: str, **overrides) -> ModelConfig:
    """A conf/model preset, checked against the schema, with overrides."""
    yaml = OmegaConf.load(CONF / "model" / f"{name}.yaml")
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml)
    return OmegaConf.to_object(OmegaConf.merge(node, overrides))


def small(**overrides) -> ModelConfig:
    """A 2-layer model that builds and steps in well under a second."""
    fields = dict(name="small", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  num_attention_heads=4, vocab_size=1000, seq_length=32)
    return ModelConfig(**{**fields, **overrides})


def build(model: ModelConfig, par=None, trainer=FP32, seed: int = 1234):
    """Seed every stream as init_parallel_state does, then build the model."""
    import torch
    from megatron.core import tensor_parallel

    from launcher.engines.model import build_gpt_model

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_gpt_model(model, par or ParallelismConfig(), trainer)
