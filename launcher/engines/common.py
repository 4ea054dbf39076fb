"""What both engines use (torch): the masked loss, AdamW's decay groups, the learning rate of a
step, the initial weights, and the scores of labels for evaluation (:func:`label_scores`)."""

from __future__ import annotations

import math
from typing import Optional

import torch


def masked_mean(token_losses: torch.Tensor, loss_mask: torch.Tensor,
                count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean of per-token losses over the tokens whose mask is set (0 when none is), in fp32.
    ``count``: how many tokens the mean is over when they span more than this tensor (the
    whole sequence of a context-parallel group); default: the mask's own."""
    mask = loss_mask.float()
    total = (token_losses.float() * mask).sum()
    return total / (mask.sum() if count is None else count).clamp(min=1)


def set_lr(torch_optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every parameter group of a torch optimizer (before its step), and
    :func:`multi_tensor_on_cpu`'s choice (a group's options come back from a checkpoint as they
    were saved, so the choice is made where the step's options are)."""
    for group in torch_optimizer.param_groups:
        group["lr"] = lr
    multi_tensor_on_cpu(torch_optimizer)


def multi_tensor_on_cpu(torch_optimizer: torch.optim.Optimizer) -> None:
    """torch's multi-tensor (``foreach``) Adam/AdamW for parameter groups on the CPU.

    torch picks its multi-tensor path by default on CUDA only; on a CPU it runs the per-tensor
    path, whose temporaries are new tensors of the parameters' size. The multi-tensor path gives
    the same bits (checked: gpt2_124m's 149 tensors, one step) 2.5x faster on one AVX2 EPYC
    thread (0.36 s against 0.91 s), and DeepSpeed's single 62M-value ZeRO partition 2.4x
    (0.56 s against 1.36 s). Groups of fused optimizers, of other optimizer classes (no
    ``foreach`` option: Transformer Engine's FusedAdam) and on a GPU are left as they are.
    Groups without parameters count as the machine's (DeepSpeed ZeRO-3 lends its groups one
    partition at a time, during its step). Called every step: it reads one parameter a group
    (torch's multi-tensor step needs a group's tensors on one device anyway)."""
    groups = torch_optimizer.param_groups
    devices = {group["params"][0].device.type for group in groups if group.get("params")}
    if devices - {"cpu"} or (not devices and torch.cuda.is_available()):
        return
    for group in groups:
        if "foreach" in group and not group.get("fused"):
            group["foreach"] = True


def param_groups(module: torch.nn.Module, weight_decay: float) -> list:
    """AdamW groups: decay on matrices, none on biases and norm weights (1-D parameters).

    The Megatron engine gets the same split from ``get_megatron_optimizer`` (its default
    no-decay rule is the same: biases and 1-D parameters)."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def initialize_weights(chunks: list, *, init_from: str, seed: int, layout_invariant: bool) -> None:
    """Weights of the freshly built model chunks, before the optimizer copies them into its
    master weights: ``trainer.init_from``'s (any layout) when set, else with
    ``layout_invariant`` a redraw that every layout shares (:mod:`.seeded_init`), else
    Megatron-Core's own per-rank draw as built."""
    if init_from:
        from launcher.engines.weights.fill import fill_chunks

        fill_chunks(chunks, init_from)
    elif layout_invariant:
        from launcher.engines.seeded_init import seed_chunks

        seed_chunks(chunks, seed=seed)


def label_scores(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                 row_ids: torch.Tensor, rows: int,
                 vocab_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scored row of a micro-batch (``row_ids`` ``[b, s]`` numbers the row each token
    belongs to, ``0 .. rows - 1``; rows may share a sequence, launcher/evals/rows.py): (summed
    log-probability of its masked labels, how many of them are not the model's argmax), both
    float64 ``[rows]``, from this tensor-parallel rank's vocabulary shard of the logits
    ``[b, s, v / tp]`` (collective over the tensor-parallel group: Megatron-Core's
    vocabulary-parallel cross entropy, and the maximum logit and the label's logit agreed over
    the shards). Ids from ``vocab_size`` on (the padding of the vocabulary; 0: none) get no
    probability, as in the model exported to Hugging Face."""
    from megatron.core import parallel_state, tensor_parallel

    from launcher.parallel import collectives

    logits = logits.float()
    group = parallel_state.get_tensor_model_parallel_group()
    shard, first = logits.size(-1), parallel_state.get_tensor_model_parallel_rank() * logits.size(-1)
    if vocab_size and first + shard > vocab_size:
        ids = torch.arange(first, first + shard, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, -math.inf)
    best = collectives.max_(logits.max(dim=-1).values.contiguous(), group)
    mine = (labels >= first) & (labels < first + shard)
    picked = logits.gather(-1, (labels - first).clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    label_logit = collectives.max_(torch.where(mine, picked, torch.full_like(picked, -math.inf)),
                                   group)
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                       labels.transpose(0, 1).contiguous())
    mask = loss_mask.double()
    per_row = row_ids.reshape(-1)

    def summed(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows, dtype=torch.float64, device=values.device).index_add_(
            0, per_row, (values.double() * mask).reshape(-1))
    return summed(-nll.transpose(0, 1)), summed((label_logit < best).double())


def scored_row_count(batch: dict) -> int:
    """How many rows ``batch``'s ``row_ids`` number (read on the host, before the batch moves)."""
    return int(batch["row_ids"].max()) + 1


def length_multiple(config) -> int:
    """What sequence lengths must be a multiple of at this layout (``config``: the model's
    TransformerConfig, or None): TP under sequence parallelism (each rank keeps a slice), 2 x CP
    under context parallelism (two chunks per rank)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    return math.lcm(tp if sequence_parallel else 1, 2 * cp if cp > 1 else 1)


def padded(batch: dict, multiple: int) -> dict:
    """``batch`` ([b, s] tokens, and labels, loss_mask, position_ids, segment_ids and row_ids
    when it has them; [b] tensors such as real_tokens unchanged) with ``s`` rounded up to
    ``multiple``: zeros after the end (masked: a causal model's earlier positions never see
    them), the positions counting on from the last (0, 1, ... when it has none), the segment
    and row ids of the last token repeated."""
    tensors = {k: torch.as_tensor(v) for k, v in batch.items()}
    b, s = tensors["tokens"].shape
    extra = -s % multiple
    if "position_ids" not in tensors:
        tensors["position_ids"] = torch.arange(s, dtype=torch.int64).expand(b, -1).clone()
    if not extra:
        return tensors
    counting = tensors["position_ids"][:, -1:] + torch.arange(1, extra + 1)
    tails = {"position_ids": counting}
    for key in ("segment_ids", "row_ids"):
        if key in tensors:
            tails[key] = tensors[key][:, -1:].expand(b, extra)
    return {k: torch.cat([v, tails.get(k, torch.zeros(b, extra, dtype=v.dtype))], dim=1)
            if v.dim() == 2 else v for k, v in tensors.items()}


def row_end_logits(logits: torch.Tensor, ends: list) -> torch.Tensor:
    """``[b, vocab]``: the logits (``[b, s, vocab / tp]``) at each row's last token
    (``ends[i] - 1``), gathered over the tensor-parallel group (greedy generation)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    rows = logits[torch.arange(len(ends), device=logits.device),
                  torch.tensor(ends, device=logits.device) - 1]
    return gather_from_tensor_model_parallel_region(rows)
