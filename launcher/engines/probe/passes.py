"""A model's forward and backward timed at one rank's shapes: :func:`pass_seconds`, and its two
ends on their own: :func:`ends_seconds`.

The probe (:mod:`launcher.runtime.probe`) asks what one transformer layer and the model's ends
(embedding, output layer, loss) cost on one rank, for every tensor-parallel size the plan may
choose. A tensor-parallel rank computes a layer with ``heads / t`` attention heads, ``groups /
t`` query groups, ``ffn / t`` MLP units and ``vocab / t`` rows of the output layer, at the full
hidden size; so the same Megatron-Core ``GPTModel``, built at TP = 1 with those sizes (the head
dimension kept), does one TP rank's compute exactly, with the same kernels, Python and autograd
in the loop. The collectives a TP layer adds are the probe's collective figures.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from launcher.config import (ModelConfig, ParallelismConfig, Precision, TrainerConfig,
                             compute_precision)
from launcher.parallel.timing import median_seconds
from launcher.shape import ResolvedModel


WARM_PASSES = 2
"""Passes run before the timed ones (oneDNN primitives, the allocator's pools)."""
MIN_TIMED_S = 0.3
"""A figure's timed passes last at least this long in all (tiny models: more repetitions)."""
MAX_REPS = 30
"""Most timed passes of one figure."""


def rank_shard(model: ModelConfig, tp: int, layers: int) -> ModelConfig:
    """``model`` with ``layers`` layers and the sizes one rank of tensor-parallel size ``tp``
    computes (module docstring); its vocabulary is the rank's shard of the padded one."""
    r = ResolvedModel.of(model, tp)
    return dataclasses.replace(
        model, num_layers=layers, num_attention_heads=r.heads // tp,
        num_query_groups=max(1, r.groups // tp), kv_channels=r.head_dim,
        ffn_hidden_size=r.ffn // tp, vocab_size=r.padded_vocab // tp,
        make_vocab_size_divisible_by=1, num_experts=0)


def synthetic_batch(micro_batch: int, seq: int, vocab: int, device=None) -> dict:
    """A micro-batch as the data loader hands it (random token ids), on ``device`` (default:
    the host, as the loader hands it over)."""
    tokens = torch.randint(0, vocab, (micro_batch, seq), dtype=torch.int64, device=device)
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1),
            "loss_mask": torch.ones(micro_batch, seq, dtype=torch.float32, device=device),
            "position_ids": torch.arange(seq, dtype=torch.int64,
                                         device=device).expand(micro_batch, seq)}


def compute_device() -> torch.device:
    """Where this rank computes: its current GPU, else the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pass_seconds(model: ModelConfig, trainer: TrainerConfig, *, micro_batch: int, reps: int,
                 barrier: Callable[[], None],
                 max_over_ranks: Callable[[float], float] = float) -> float:
    """Median seconds of one forward, loss and backward of ``model`` (built at TP = 1 on an
    initialised parallel state) on a micro-batch of ``micro_batch`` sequences (the timing:
    :func:`_median_seconds`)."""
    device = compute_device()
    gpt = _built(model, trainer)
    batch = synthetic_batch(micro_batch, model.seq_length, model.vocab_size, device)

    def one() -> None:
        loss = gpt(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        (loss.float() * batch["loss_mask"]).sum().backward()

    seconds = _median_seconds(one, device, reps, barrier, max_over_ranks)
    gpt.zero_grad(set_to_none=True)
    return seconds


def ends_seconds(model: ModelConfig, trainer: TrainerConfig, *, micro_batch: int, reps: int,
                 barrier: Callable[[], None],
                 max_over_ranks: Callable[[float], float] = float) -> tuple[float, float]:
    """Median seconds of the model's two ends, each timed on its own (forward and backward):
    the embedding (a first stage's extra work) and the final norm, output layer and loss (a
    last stage's), with Megatron-Core's own modules of ``model`` built at TP = 1. Timed apart,
    not as the difference of two whole passes: at small sizes an end costs less than the noise
    of a pass, and a difference of two noisy medians came out at zero or below."""
    device = compute_device()
    gpt = _built(dataclasses.replace(model, num_layers=1), trainer)
    inner = getattr(gpt, "module", gpt)  # under Float16Module, the GPTModel it wraps
    batch = synthetic_batch(micro_batch, model.seq_length, model.vocab_size, device)
    dtype = next(inner.parameters()).dtype
    hidden = torch.randn(model.seq_length, micro_batch, model.hidden_size, device=device,
                         dtype=dtype, requires_grad=True)
    labels, norm = batch["labels"], getattr(inner.decoder, "final_layernorm", None)

    def embedding() -> None:
        inner.embedding(batch["tokens"], batch["position_ids"]).float().sum().backward()

    def output() -> None:
        weight = inner.shared_embedding_or_output_weight() \
            if inner.share_embeddings_and_output_weights else None
        normed = norm(hidden) if norm is not None else hidden
        logits, _ = inner.output_layer(normed, weight=weight)
        loss = inner.compute_language_model_loss(labels, logits)
        (loss.float() * batch["loss_mask"]).sum().backward()

    seconds = tuple(_median_seconds(f, device, reps, barrier, max_over_ranks)
                    for f in (embedding, output))
    gpt.zero_grad(set_to_none=True)
    return seconds


def _built(model: ModelConfig, trainer: TrainerConfig):
    """Megatron-Core's GPTModel of ``model`` at TP = 1, wrapped as the engines wrap it."""
    from launcher.engines.model import build_gpt_model

    gpt = build_gpt_model(model, ParallelismConfig(tensor_parallel_size=1, zero_stage=0), trainer)
    if compute_precision(trainer.precision) in (Precision.bf16, Precision.fp16):
        from megatron.core.transformer.module import Float16Module

        gpt = Float16Module(gpt.config, gpt)  # as the engines wrap it: the same casts
    return gpt


def _median_seconds(one: Callable[[], None], device: torch.device, reps: int,
                    barrier: Callable[[], None], max_over_ranks: Callable[[float], float]) -> float:
    """Median seconds of ``one()`` after :data:`WARM_PASSES`. ``barrier`` lines up the ranks
    before each timed pass, so that all of them compute at once (as they do in training: the
    memory bandwidth they share is part of the figure); short passes are repeated up to
    :data:`MIN_TIMED_S` of timing (every rank as often as the one that needs most:
    ``max_over_ranks``), so that a difference of two figures is not noise."""
    once = median_seconds(one, reps=1, warmup=WARM_PASSES - 1, device=device)
    reps = max(reps, min(MAX_REPS, int(MIN_TIMED_S / max(once, 1e-6))))
    return median_seconds(one, reps=int(max_over_ranks(reps)), warmup=0, device=device,
                          before=barrier)
