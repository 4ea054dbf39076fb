"""Scores of labels through Megatron-Core's forward-only schedules: :func:`score_batches`
(any pipeline schedule, tensor and context parallel), used by the Megatron engine during
training and, through :class:`ChunkScorer`, by ``launcher.evaluate`` on a checkpoint's weights
(model chunks filled by :func:`launcher.engines.weights.fill.fill_chunks`).

The micro-batches come sized to their rows (:mod:`launcher.evals.rows`), several rows to a
sequence where they are packed: shapes differ from one to the next. A packed micro-batch goes to
the attention as THD sequences under Transformer Engine, else with an explicit mask that keeps
each row to itself (:mod:`launcher.engines.packed_rows`). Here each is padded to a length the
layout can split (a multiple of TP under sequence parallelism, of 2 x CP under context
parallelism), and each run of equal shapes goes through one schedule call (a schedule sends one
activation shape between stages), padded with empty micro-batches to a multiple of PP under the
interleaved schedule, which refuses fewer."""

from __future__ import annotations

from typing import Optional

import torch

from launcher.engines.common import label_scores, length_multiple, padded, scored_row_count
from launcher.engines.packed_rows import on_the_device
from launcher.parallel import collectives


def _filler(batch: dict) -> dict:
    """A micro-batch of ``batch``'s shape that counts nothing (mask all zero)."""
    return {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}


def _layout() -> tuple[int, bool]:
    """(context-parallel size, whether packed rows go to the attention as THD sequences)."""
    from megatron.core import parallel_state

    from launcher.engines.model import use_transformer_engine

    return parallel_state.get_context_parallel_world_size(), use_transformer_engine()


def score_batches(chunks: list, batches: list, *, device: torch.device,
                  vocab_size: int) -> Optional[list]:
    """:meth:`launcher.engines.base.Engine.label_scores` of ``batches`` (this replica's, of
    any shapes) through ``chunks`` (in eval mode): the module docstring."""
    from megatron.core import parallel_state

    multiple = length_multiple(getattr(chunks[0], "config", None))
    cp, thd = _layout()
    batches = [padded(b, multiple) for b in batches]
    group = parallel_state.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    out, start, counted = [], 0, False
    while start < len(batches):
        shape, kind = batches[start]["tokens"].shape, "segment_ids" in batches[start]
        end = start
        while end < len(batches) and batches[end]["tokens"].shape == shape \
                and ("segment_ids" in batches[end]) == kind:
            end += 1
        run = batches[start:end] + [_filler(batches[start])] * (-(end - start) % group)
        counts = [scored_row_count(b) for b in run]
        ready = [on_the_device(b, device, thd=thd, cp=cp) for b in run]
        length, rows = shape[1], shape[0]
        if "packed_seq_params" in ready[0]:  # [1, b * s]: the stages' shapes
            length, rows = length * rows, 1
        scores = chunk_label_scores(chunks, ready, counts, seq_length=length // cp,
                                    micro_batch_size=rows, vocab_size=vocab_size)
        if scores is not None:
            counted = True
            out += scores[:end - start]
        start = end
    return out if counted else None


def chunk_label_scores(chunks: list, batches: list, counts: list, *, seq_length: int,
                       micro_batch_size: int, vocab_size: int) -> Optional[list]:
    """See :meth:`launcher.engines.base.Engine.label_scores`; ``batches`` already on this rank
    (:func:`launcher.engines.packed_rows.on_the_device`), ``counts`` the rows each
    numbers, the chunks in eval mode; vocabulary padding (ids from ``vocab_size`` on) gets no
    probability."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        batch, count = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                       packed_seq_params=batch.get("packed_seq_params"))

        def score(logits):
            logprob, misses = label_scores(logits, batch["labels"], batch["loss_mask"],
                                           batch["row_ids"], count, vocab_size)
            return logits.float().sum() * 0.0, {"logprob": logprob.cpu(), "misses": misses.cpu()}
        return output, score

    many = len(chunks) > 1
    data = [iter(list(zip(batches, counts))) for _ in chunks]
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data if many else data[0],
            model=chunks if many else chunks[0], num_microbatches=len(batches),
            seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=True)
    counts = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and \
        parallel_state.get_tensor_model_parallel_rank() == 0
    return [(d["logprob"], d["misses"]) for d in out] if counts else None


def data_parallel() -> tuple[int, int]:
    """(this rank's data-parallel replica, replicas), context-parallel ranks of a replica alike."""
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size())


class ChunkScorer:
    """A checkpoint's model chunks as the scorer :mod:`launcher.runtime.evaluation` drives."""

    def __init__(self, chunks: list, *, vocab_size: int):
        self.chunks, self.vocab_size = chunks, vocab_size
        self.device = collectives.device_for()
        for chunk in chunks:
            chunk.eval()

    def label_scores(self, batches: list) -> Optional[list]:
        return score_batches(self.chunks, batches, device=self.device,
                             vocab_size=self.vocab_size)

    def next_tokens(self, tokens: torch.Tensor, ends: list) -> list:
        from launcher.engines.megatron.generation import next_tokens

        with torch.no_grad():
            return next_tokens(self.chunks, tokens, ends, vocab_size=self.vocab_size,
                               device=self.device)

    data_parallel = staticmethod(data_parallel)
