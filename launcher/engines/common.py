"""What both engines use (torch): the masked loss, AdamW's decay groups, the learning rate of a
step and the initial weights."""

from __future__ import annotations

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
    """Write ``lr`` into every parameter group of a torch optimizer (before its step)."""
    for group in torch_optimizer.param_groups:
        group["lr"] = lr


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
