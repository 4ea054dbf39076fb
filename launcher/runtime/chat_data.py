"""Training data of ``data.format=chat``: the packed rows that ``data_prep format=chat`` wrote.

Each shard is two Megatron-Core indexed datasets read with megatron-core's own
``IndexedDataset``: ``<prefix>`` (token ids; a sequence per conversation, a document per packed
row) and ``<prefix>.mask`` (the loss mask, the same sequences and rows). A training sample is one
row, padded to ``seq_length + 1`` tokens:

- ``tokens``/``labels``: the row's ids and the same shifted by one;
- ``loss_mask``: the label's mask, 0 where a label starts another conversation (it would be
  predicted from the one before) and on padding;
- ``position_ids``: restarting at 0 for every conversation (learned position embeddings see each
  alone; rotary ones are relative anyway);
- ``segment_ids``: which conversation each input token belongs to (0, 1, ...; the padding is
  one more): the model attends within a segment only, so a conversation packed after another
  gives the logits it gives alone. The engine turns them into what its attention takes, per
  micro-batch on the device (:mod:`launcher.engines.packed_rows`): an explicit mask
  for Megatron-Core's local attention, ``cu_seqlens`` for Transformer Engine's. A sample is
  linear in ``s`` (about 40 bytes a token), never an ``[s, s]`` mask;
- ``real_tokens``: how many of the ``s`` input tokens are conversations (the rest is padding),
  which the THD layout under Transformer Engine needs to pad conversations for context
  parallelism (:mod:`launcher.engines.packed_rows`).

Rows are split train/validation/test by ``data.split`` within each shard, and the training rows
are visited in a fresh permutation per epoch drawn from (seed, epoch): the row of global sample
``i`` is a pure function of ``i``, so a resume at ``consumed_samples`` sees each row once per
epoch, as an uninterrupted run does.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import numpy as np
import torch


class ChatRows:
    """Every row of the chat shards of ``prefixes``: (shard, first sequence, end sequence)."""

    def __init__(self, prefixes: Sequence[str]):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.tokens, self.masks, self.rows = [], [], []
        for shard, prefix in enumerate(prefixes):
            missing = [p for p in (prefix + ".bin", prefix + ".idx", prefix + ".mask.bin",
                                   prefix + ".mask.idx") if not os.path.exists(p)]
            if missing:
                raise FileNotFoundError(f"chat data prefix {prefix!r}: missing "
                                        f"{', '.join(missing)} (data_prep format=chat writes "
                                        "both the tokens and their .mask)")
            self.tokens.append(IndexedDataset(prefix))
            self.masks.append(IndexedDataset(prefix + ".mask"))
            bounds = self.tokens[-1].document_indices
            self.rows.append([(shard, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])])

    def split(self, split: str) -> List[List[tuple]]:
        """[train, valid, test] rows: each shard's rows cut by the ``data.split`` weights."""
        weights = np.array([float(w) for w in split.replace("/", ",").split(",")], dtype=float)
        weights = np.pad(weights, (0, 3 - len(weights)))[:3]
        parts: List[List[tuple]] = [[], [], []]
        for rows in self.rows:
            cuts = np.round(np.cumsum(weights / weights.sum()) * len(rows)).astype(int)
            start = 0
            for k, end in enumerate(cuts):
                parts[k] += rows[start:end]
                start = end
        return parts

    def row(self, row: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, mask, conversation index of each token) of one row."""
        shard, first, end = row
        ids, masks, seg = [], [], []
        for k, index in enumerate(range(first, end)):
            ids.append(self.tokens[shard][index])
            masks.append(self.masks[shard][index])
            seg.append(np.full(len(ids[-1]), k, dtype=np.int64))
        return np.concatenate(ids), np.concatenate(masks), np.concatenate(seg)


def packed_sample(ids: np.ndarray, mask: np.ndarray, seg: np.ndarray, seq_length: int,
                  pad_id: int) -> dict:
    """The training sample of one row (module docstring); the row holds <= seq_length + 1."""
    n = seq_length + 1
    if len(ids) > n:
        raise ValueError(f"a row of {len(ids)} tokens is longer than seq_length + 1 = {n}: the "
                         "shards were packed for another model.seq_length")
    pad = n - len(ids)
    ids = np.concatenate([ids, np.full(pad, pad_id, dtype=np.int64)]).astype(np.int64)
    mask = np.concatenate([mask, np.zeros(pad, dtype=mask.dtype)]).astype(bool)
    seg = np.concatenate([seg, np.full(pad, seg.max(initial=-1) + 1, dtype=np.int64)])
    starts = np.r_[True, seg[1:] != seg[:-1]]
    positions = np.arange(n) - np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    label_mask = mask[1:] & ~starts[1:]
    return {"tokens": torch.from_numpy(ids[:-1].copy()),
            "labels": torch.from_numpy(ids[1:].copy()),
            "loss_mask": torch.from_numpy(label_mask.astype(np.float32)),
            "position_ids": torch.from_numpy(positions[:-1].astype(np.int64)),
            "segment_ids": torch.from_numpy(seg[:-1].copy()),
            "real_tokens": torch.tensor(min(n - pad, seq_length))}


class PackedChatDataset(torch.utils.data.Dataset):
    """``samples`` training samples over ``rows``, a permutation of them per epoch."""

    def __init__(self, data: ChatRows, rows: List[tuple], *, samples: int, seq_length: int,
                 pad_id: int, seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("no chat rows in this split; give it a share in data.split or "
                             "prepare more conversations")
        self.data, self.rows, self.samples = data, rows, samples
        self.seq_length, self.pad_id, self.seed, self.shuffle = seq_length, pad_id, seed, shuffle
        self._order: dict = {}

    def __len__(self) -> int:
        return self.samples

    def row_of(self, index: int) -> tuple:
        epoch, position = divmod(index, len(self.rows))
        if not self.shuffle:
            return self.rows[position]
        if epoch not in self._order:
            self._order = {epoch: np.random.default_rng([self.seed, epoch]).permutation(
                len(self.rows))}
        return self.rows[int(self._order[epoch][position])]

    def __getitem__(self, index: int) -> dict:
        return packed_sample(*self.data.row(self.row_of(index)), self.seq_length, self.pad_id)


def build_chat_datasets(data, *, seq_length: int, seed: int, train_samples: int,
                        eval_samples: int) -> List[Optional[PackedChatDataset]]:
    """[train, valid, test] over the chat shards of ``data.prefixes`` (None: an empty split)."""
    rows = ChatRows(data.prefixes)
    train, valid, test = rows.split(data.split)
    common = dict(seq_length=seq_length, pad_id=data.eod_token_id, seed=seed)
    return [PackedChatDataset(rows, train, samples=train_samples, **common),
            PackedChatDataset(rows, valid, samples=eval_samples, shuffle=False, **common)
            if valid else None,
            PackedChatDataset(rows, test, samples=eval_samples, shuffle=False, **common)
            if test else None]
