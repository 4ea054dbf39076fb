"""What every engine shares: the step result, the masked loss, loss agreement across ranks and
the non-finite error. :mod:`launcher.engine` (DeepSpeed) and :mod:`launcher.megatron_engine`
(Megatron-Core) both build on it, so the training loop sees one contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


class NonFiniteLoss(RuntimeError):
    """A micro-batch produced a NaN/inf loss on some rank (raised under nan_policy=abort)."""


@dataclass
class StepResult:
    """What one optimizer step reports (loss averaged over micro-batches and data-parallel ranks).

    ``extra`` holds engine-specific metrics that the loop logs as they are (e.g.
    ``moe/load_balancing_loss``)."""

    loss: float
    grad_norm: Optional[float]
    loss_scale: float
    skipped: bool
    micro_batches: int
    extra: dict = field(default_factory=dict)


def masked_mean(token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-token losses over the tokens whose mask is set (0 when none is)."""
    mask = loss_mask.to(token_losses.dtype)
    return (token_losses.float() * mask).sum() / mask.sum().clamp(min=1)


def agree_loss(loss_sum: torch.Tensor, count: float, finite: bool,
               group=None) -> tuple[float, float, bool]:
    """One all-reduce of (sum of losses, how many, any non-finite) over ``group``.

    Returns (total, total count, every rank finite). A rank with a non-finite loss contributes 0
    to the sum, so the total stays finite and every rank learns the same verdict."""
    value = loss_sum.detach().float().reshape(())
    packed = torch.stack([value if finite else torch.zeros_like(value),
                          torch.tensor(float(count), device=value.device),
                          torch.tensor(0.0 if finite else 1.0, device=value.device)])
    torch.distributed.all_reduce(packed, group=group)
    return float(packed[0]), float(packed[1]), float(packed[2]) == 0.0


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
