"""Initial weights that do not depend on the layout: every random value is a function of
``trainer.seed``, the tensor's global name and its place in the global tensor.

Megatron-Core draws each rank's weights from that rank's generator (offset per pipeline stage,
and per TP rank for expert weights), so TP=1 and TP=2, PP=1 and PP=2, or the two engines start
from different models. Here every random matrix of a model chunk is redrawn from its
``sharded_state_dict`` description (dist-checkpointing key, offsets along the stacked
layer/expert axes, global shape, this rank's slice): the global matrix is cut into fixed tiles
of at most ``TILE`` x ``TILE``; each tile has its own generator seeded from
(seed, key, layer/expert index, tile row, tile column), and a rank draws only the tiles its slice
touches. So a rank's cost is its own parameters plus the tile borders, whatever the model size.

What is drawn follows Megatron-Core's defaults (``TransformerConfig``): every parameter with two
or more dimensions is normal with ``init_method_std``; the output projections of attention and
MLP (``linear_proj``, ``linear_fc2``, experts too) with ``init_method_std / sqrt(2 num_layers)``;
one-dimensional parameters (norm weights, biases) keep Megatron-Core's constants, which are
already the same everywhere. ``tests/test_seeded_init.py`` checks these rules against the
library's own draw, so a library that changes its init fails there.

Values are drawn in fp32 and cast to the parameter's dtype. Generators differ between devices
(CPU and CUDA draw different streams for one seed): layouts agree on one kind of device.
The rows a padded vocabulary adds (``make_vocab_size_divisible_by`` x TP) exist only in the
layouts that pad that far; the rows both layouts have are the same.
"""

from __future__ import annotations

import hashlib
import math

import torch

TILE = 1024
"""Rows and columns of one independently seeded tile of a global matrix."""

SCALED_OUTPUT = ("linear_proj.weight", "linear_fc2.weight")
"""Key endings that Megatron-Core initialises with ``output_layer_init_method``."""


class UnsupportedParameter(RuntimeError):
    """A parameter whose slice this module cannot redraw; the message names it and the fix."""


def tile_seed(seed: int, key: str, stacked: tuple, row: int, col: int) -> int:
    """The generator seed of one tile: a hash of everything that names it, not of the rank."""
    text = f"{seed}|{key}|{','.join(map(str, stacked))}|{row}|{col}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def init_std(key: str, *, std: float, num_layers: int) -> float:
    """Megatron-Core's default normal std for the parameter named ``key``."""
    if key.endswith(SCALED_OUTPUT):
        return std / math.sqrt(2.0 * num_layers)
    return std


def _spans(offset: int, length: int, full: int) -> range:
    """Tile indices along one axis that the slice [offset, offset + length) touches."""
    size = min(TILE, full)
    return range(offset // size, (offset + length - 1) // size + 1)


@torch.no_grad()
def draw_slice(out: torch.Tensor, *, key: str, stacked: tuple, global_shape: tuple,
               offset: tuple, seed: int, std: float, generator: torch.Generator) -> None:
    """Fill ``out`` (this rank's slice of a 2-D global matrix, starting at ``offset``) with the
    seeded tiles it overlaps."""
    rows, cols = global_shape
    tile_rows, tile_cols = min(TILE, rows), min(TILE, cols)
    for ti in _spans(offset[0], out.shape[0], rows):
        for tj in _spans(offset[1], out.shape[1], cols):
            generator.manual_seed(tile_seed(seed, key, stacked, ti, tj))
            tile = torch.randn(tile_rows, tile_cols, generator=generator, device=out.device,
                               dtype=torch.float32)
            r0, c0 = max(ti * tile_rows, offset[0]), max(tj * tile_cols, offset[1])
            r1 = min((ti + 1) * tile_rows, offset[0] + out.shape[0])
            c1 = min((tj + 1) * tile_cols, offset[1] + out.shape[1])
            part = tile[r0 - ti * tile_rows:r1 - ti * tile_rows,
                        c0 - tj * tile_cols:c1 - tj * tile_cols]
            out[r0 - offset[0]:r1 - offset[0], c0 - offset[1]:c1 - offset[1]].copy_(part * std)


def _drawn_items(model) -> list:
    """The ShardedTensors of ``model`` whose values are random (two or more global dims)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    state, _, _ = load_preprocess(model.sharded_state_dict())
    return [item for item in nested_values(state) if isinstance(item, ShardedTensor)
            and len(item.global_shape) - item.prepend_axis_num >= 2]


def _check_views(model, items: list) -> None:
    """Every slice written must be a view of a parameter, or the write would be lost."""
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for item in items:
        if item.data.untyped_storage().data_ptr() not in storages:
            raise UnsupportedParameter(
                f"{item.key}: its sharded_state_dict slice is a copy, not a view of the "
                "parameter, so it cannot be redrawn in place; set "
                "trainer.layout_invariant_init=false")
        if len(item.global_shape) - item.prepend_axis_num != 2:
            raise UnsupportedParameter(
                f"{item.key}: {len(item.global_shape) - item.prepend_axis_num}-D parameters "
                "are not supported; set trainer.layout_invariant_init=false")


def seed_chunk(chunk, *, seed: int) -> int:
    """Redraw every random parameter of one GPTModel chunk; returns the elements written."""
    from megatron.core.utils import unwrap_model

    model = unwrap_model(chunk)
    config = model.config
    items = _drawn_items(model)
    _check_views(model, items)
    generator = None
    written = 0
    for item in items:
        p = item.prepend_axis_num
        if generator is None or generator.device != item.data.device:
            generator = torch.Generator(device=item.data.device)
        std = init_std(item.key, std=config.init_method_std, num_layers=config.num_layers)
        draw_slice(item.data, key=item.key, stacked=tuple(item.global_offset[:p]),
                   global_shape=tuple(item.global_shape[p:]),
                   offset=tuple(item.global_offset[p:]), seed=seed, std=std,
                   generator=generator)
        written += item.data.numel()
    return written


def seed_chunks(chunks: list, *, seed: int) -> int:
    """Layout-invariant initial weights for this rank's model chunks (no communication)."""
    return sum(seed_chunk(chunk, seed=seed) for chunk in chunks)
