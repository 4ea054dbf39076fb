"""Megatron-Core dist-checkpointing (``torch_dist``) behind DeepSpeed's checkpoint interface.

:class:`MegatronCheckpointIO` offers ``save_checkpoint(save_dir, tag)`` and
``load_checkpoint(load_dir, tag)``, the two calls :mod:`launcher.checkpoint` makes on a DeepSpeed
engine, so the Megatron engine goes through the same atomic protocol (``step_N.tmp`` ->
``complete`` -> rename -> ``latest``) and the same RNG-state files. The model and optimizer are
saved as sharded state dicts in model space (the optimizer with
``fully_sharded_model_space``), so a checkpoint written with one TP/PP/DP layout loads into
another: tensors are addressed by global name and global slice, not by rank.
"""

from __future__ import annotations

from pathlib import Path

import torch

SUBDIR = "megatron"
"""Directory inside a step directory that holds the torch_dist files."""

_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_state(chunks: list) -> dict:
    """Sharded state dict of every GPTModel chunk (DDP/Float16Module unwrapped, so keys are the
    model's own names, with global layer numbers)."""
    from megatron.core.utils import unwrap_model

    return {f"chunk{i}": unwrap_model(chunk).sharded_state_dict()
            for i, chunk in enumerate(chunks)}


def _full_state(chunks: list, optimizer, is_loading: bool, with_optimizer: bool = True) -> dict:
    state = {"model": _model_state(chunks)}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            state["model"], is_loading=is_loading, metadata=_OPTIMIZER_METADATA)
    return state


class MegatronCheckpointIO:
    """Save/load a Megatron engine's chunks and optimizer with ``dist_checkpointing``."""

    def __init__(self, chunks: list, optimizer):
        self.chunks, self.optimizer = chunks, optimizer

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False) -> None:
        """Write ``<save_dir>/<tag>/megatron`` (collective; ``save_latest`` is ignored: the
        caller owns the ``latest`` pointer)."""
        from megatron.core import dist_checkpointing

        target = Path(save_dir) / tag / SUBDIR
        if torch.distributed.get_rank() == 0:
            target.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(_full_state(self.chunks, self.optimizer, is_loading=False),
                                str(target))

    def load_checkpoint(self, load_dir: str, tag: str, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = False):
        """Load ``<load_dir>/<tag>/megatron`` into this layout; returns (path, None) like
        DeepSpeed (the lr schedule is recomputed from the step, so there is none to load)."""
        from megatron.core import dist_checkpointing

        source = Path(load_dir) / tag / SUBDIR
        if not source.is_dir():
            raise FileNotFoundError(f"{source} does not exist (not a Megatron checkpoint?)")
        state = _full_state(self.chunks, self.optimizer, is_loading=True,
                            with_optimizer=load_optimizer_states)
        loaded = dist_checkpointing.load(state, str(source))
        from megatron.core.utils import unwrap_model

        for i, chunk in enumerate(self.chunks):
            unwrap_model(chunk).load_state_dict(loaded["model"][f"chunk{i}"])
        if load_optimizer_states:
            self.optimizer.load_state_dict(loaded["optimizer"])
        return str(source), None
