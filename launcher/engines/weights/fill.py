"""Put a weight source's tensors into this rank's Megatron-Core model chunks, at any layout.

Megatron-Core describes every local parameter as a slice of a global tensor
(``sharded_state_dict``: key, global shape, offsets along the stacked layer/expert axes and the
TP/EP-split axes, and factories such as SwiGLU's split ``linear_fc1``). :func:`fill_chunks`
walks that description and copies the matching slice of each global tensor from the source, so
the same code loads a TP=2, PP=2 x VPP=2 or EP=2 model. An engine=megatron checkpoint is read
natively instead (:func:`load_torch_dist`: Megatron-Core's own resharding load).

Call it on the freshly built chunks, before an optimizer copies the weights into its fp32 master
copies (Megatron-Core's optimizers and DeepSpeed both do at construction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class IncompleteWeights(RuntimeError):
    """The source left parameters of the model unset; the message names them."""


def _unwrap(chunk):
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _load_exact(module: torch.nn.Module, tensors: dict, source: str) -> None:
    """``module.load_state_dict(tensors)``; every parameter must be set (``_extra_state`` of
    layers that carry none may be absent)."""
    result = module.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise IncompleteWeights(f"{source}: no weights for {len(missing)} parameter(s): "
                                + ", ".join(missing[:8]))


@torch.no_grad()
def fill_chunk(chunk, source, label: str = "") -> None:
    """Copy every local parameter of one GPTModel chunk from ``source`` (see
    :mod:`launcher.engines.weights.sources`)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                          apply_factory_merges)
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    from launcher.engines.weights.mapping import stacked_address

    model = _unwrap(chunk)
    state, _, factories = load_preprocess(model.sharded_state_dict())
    last: dict[Any, torch.Tensor] = {}

    def read(item):
        if isinstance(item, ShardedObject):
            return None
        if not isinstance(item, ShardedTensor):
            return item
        p = item.prepend_axis_num
        address = stacked_address(item.key, tuple(item.global_offset[:p]))
        if address not in last:
            last.clear()
            last[address] = source.tensor(*address, tuple(item.global_shape[p:]))
        region = tuple(slice(o, o + n) for o, n in zip(item.global_offset[p:], item.data.shape))
        return last[address][region].to(item.data.dtype).clone()

    dict_list_map_inplace(read, state)
    merged = apply_factory_merges(state, factories)
    tensors = {k: v for k, v in merged.items() if v is not None}
    _load_exact(model, tensors, label or str(getattr(source, "path", "source")))


def load_torch_dist(chunks: list, step_dir: Path) -> None:
    """Load the model tensors of an engine=megatron step directory into ``chunks`` through
    Megatron-Core's resharding load (collective over all ranks)."""
    from megatron.core import dist_checkpointing

    from launcher.engines import compat

    state = {f"chunk{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}
    with compat.checkpoint_loads_without_code():
        loaded = dist_checkpointing.load(state, str(Path(step_dir) / "megatron"))
    for i, chunk in enumerate(chunks):
        _load_exact(_unwrap(chunk), loaded[f"chunk{i}"], str(step_dir))


def fill_chunks(chunks: list, path: str) -> None:
    """Initialise ``chunks`` (this rank's model chunks, any layout) from the weights at ``path``
    (an HF directory or a trainwright run / checkpoints / step directory); collective when the
    weights are an engine=megatron checkpoint."""
    from launcher.engines.weights.sources import open_source, step_dir_of

    p = Path(path)
    if not (p / "config.json").is_file():
        p = step_dir_of(p)
        if (p / "megatron").is_dir():
            return load_torch_dist(chunks, p)
    source = open_source(p)
    for chunk in chunks:
        fill_chunk(chunk, source, label=str(path))
