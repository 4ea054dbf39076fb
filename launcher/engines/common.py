"""Step helpers both engines use (torch): the masked loss and AdamW's decay groups."""

from __future__ import annotations

import torch


def masked_mean(token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-token losses over the tokens whose mask is set (0 when none is)."""
    mask = loss_mask.to(token_losses.dtype)
    return (token_losses.float() * mask).sum() / mask.sum().clamp(min=1)


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


def load_initial_weights(chunks: list, init_from: str) -> None:
    """``trainer.init_from``: copy the weights at that path into the freshly built model chunks
    (any layout), before the optimizer copies them into its master weights; nothing when empty."""
    if init_from:
        from launcher.convert.fill import fill_chunks

        fill_chunks(chunks, init_from)
