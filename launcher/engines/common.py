"""What both engines use (torch): the masked loss, AdamW's decay groups, the learning rate of a
step and the initial weights."""

from __future__ import annotations

import torch


def masked_mean(token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-token losses over the tokens whose mask is set (0 when none is)."""
    mask = loss_mask.to(token_losses.dtype)
    return (token_losses.float() * mask).sum() / mask.sum().clamp(min=1)


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
