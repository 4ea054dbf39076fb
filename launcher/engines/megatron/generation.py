"""Token-by-token generation with Megatron-Core model chunks at any TP/PP/VPP/EP layout.

Each step runs the whole sequence forward through ``get_forward_backward_func()`` with
``forward_only`` (so pipeline stages exchange activations as in training); the last stage
gathers the vocabulary-parallel logits over the TP group, drops the padded vocabulary, picks
the next token (greedy, or temperature + top-p with a seeded generator that is the same on
every rank) and broadcasts it over the pipeline group.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from launcher.config import GenerateConfig
from launcher.parallel import collectives


class Generator:
    def __init__(self, chunks: list, *, vocab_size: int):
        from megatron.core import parallel_state as ps

        self.chunks, self.vocab_size = chunks, vocab_size
        self.ps = ps
        self.device = collectives.device_for()
        for chunk in chunks:
            chunk.eval()

    def last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage(ignore_virtual=True)

    def writes_logits(self) -> bool:
        """The one rank that writes the logits file (last stage, TP rank 0, DP rank 0)."""
        return self.last_stage() and self.ps.get_tensor_model_parallel_rank() == 0 and \
            self.ps.get_data_parallel_rank() == 0

    def prints(self) -> bool:
        return collectives.rank() == 0

    def _logits(self, ids: list[int]) -> Optional[torch.Tensor]:
        """[len(ids), vocab] logits on the last stage (None elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        tokens = torch.tensor([ids], device=self.device)
        positions = torch.arange(len(ids), device=self.device).unsqueeze(0)

        def forward_step(data_iterator, model):
            next(data_iterator)
            output = model(tokens, positions, None)

            def keep(output_tensor, non_loss_data=False):
                return gather_from_tensor_model_parallel_region(output_tensor)
            return output, keep

        data = [iter([None]) for _ in self.chunks]
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data if len(data) > 1 else data[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0], num_microbatches=1,
            seq_length=len(ids), micro_batch_size=1, forward_only=True,
            collect_non_loss_data=True)
        if not self.last_stage():
            return None
        return out[0][0, :, :self.vocab_size].float()

    def _pick(self, logits: torch.Tensor, gen, rng: torch.Generator) -> int:
        if gen.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / gen.temperature, dim=-1)
        if gen.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(ordered, dim=0) - ordered < gen.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
        return int(torch.multinomial(probs / probs.sum(), 1, generator=rng))

    def _share(self, token: int) -> int:
        """The last stage's token on every rank of the pipeline group."""
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return token
        return collectives.broadcast_int(token, self.ps.get_pipeline_model_parallel_last_rank(),
                                         self.ps.get_pipeline_model_parallel_group())

    def generate(self, ids: list[int], gen: GenerateConfig, stop: Callable[[], bool] = bool,
                 stop_ids: frozenset = frozenset()) -> tuple[list[int], Optional[torch.Tensor]]:
        """(new token ids, the prompt's logits on the last stage). ``stop()`` is asked before
        each token (a collective: every rank asks at the same token); True ends the loop. A
        token of ``stop_ids`` (an end-of-turn) ends it after that token."""
        rng = torch.Generator().manual_seed(gen.seed)
        sequence, new = list(ids), []
        logits = self._logits(sequence)  # collective: every rank runs each forward
        prompt_logits = None if logits is None else logits.cpu()
        for step in range(gen.max_new_tokens):
            if stop():
                break
            if step:
                logits = self._logits(sequence)
            token = self._pick(logits[-1].cpu(), gen, rng) if logits is not None else -1
            token = self._share(token)
            sequence.append(token)
            new.append(token)
            if token in stop_ids:  # the same token on every rank: every rank stops here
                break
        return new, prompt_logits


def next_tokens(chunks: list, tokens: torch.Tensor, ends: list, *, vocab_size: int,
                device: torch.device) -> list:
    """The greedy next token of each row of ``tokens`` ([b, s] on the host, each row's own
    tokens first: ``ends[i]`` of them, zeros after), on every rank of this replica's pipeline:
    one forward-only pass through ``chunks`` (any TP/PP/VPP/EP; the length padded to what
    sequence parallelism splits), the last stage's logits at each row's end gathered over the
    tensor-parallel group, the padded vocabulary dropped, and the ids broadcast over the
    pipeline group. Collective within the replica."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from launcher.engines.common import length_multiple, padded, row_end_logits

    batch = padded({"tokens": tokens}, length_multiple(getattr(chunks[0], "config", None)))
    batch = {k: v.to(device) for k, v in batch.items()}

    def forward_step(data_iterator, model):
        next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None)

        def keep(output_tensor, non_loss_data=False):
            return row_end_logits(output_tensor, ends)
        return output, keep

    data = [iter([None]) for _ in chunks]
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data if len(data) > 1 else data[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1,
        seq_length=batch["tokens"].shape[1], micro_batch_size=len(ends), forward_only=True,
        collect_non_loss_data=True)
    ids = [0] * len(ends)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        ids = out[0][:, :vocab_size].float().argmax(dim=-1).tolist()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return ids
    return collectives.broadcast_ints(ids, ps.get_pipeline_model_parallel_last_rank(),
                                      ps.get_pipeline_model_parallel_group())

