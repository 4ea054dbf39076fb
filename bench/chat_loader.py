"""The chat data loader's memory and throughput at long sequences: segment ids against the dense
``[s, s]`` mask each row carried before (issue 48).

    .venv/bin/python bench/chat_loader.py [--lengths 8192 32768] [--rows 24] [--json out.json]

For each sequence length, one set of chat shards (data_prep's ShardWriter: rows of 4-12
conversations of random ids filling about 95% of a row) read through
:class:`launcher.runtime.chat_data.PackedChatDataset` and a ``torch.utils.data.DataLoader`` with
one worker and micro-batch 1, as training reads it:

- **now**: the samples as the loader yields them (segment ids, linear in ``s``);
- **before**: the same samples plus the ``[1, s, s]`` boolean mask the loader built per row
  until this change (rebuilt here by the old formula, in the same worker, so the two differ by
  the mask alone).

Reported per length: the bytes of one sample's tensors, the rows per second through the loader
(after one warm row), and for "now" the cost of :func:`attention_cut` building the mask of one
micro-batch where Megatron-Core's local attention (the CPU path) needs it. The two variants run
side by side in one process; the ratio is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.engines.packed_rows import attention_cut  # noqa: E402
from launcher.runtime.chat_data import ChatRows, PackedChatDataset  # noqa: E402


def write_rows(folder: str, s: int, rows: int, seed: int = 0) -> str:
    """Chat shards of ``rows`` rows of ``s + 1`` tokens at most (4-12 conversations each)."""
    from data_prep.shards import ShardWriter

    rng = np.random.default_rng(seed)
    tokens = ShardWriter(folder, "chat_00000", np.uint16)
    masks = ShardWriter(folder, "chat_00000.mask", np.uint8)
    for _ in range(rows):
        parts = rng.dirichlet(np.ones(int(rng.integers(4, 13)))) * (s + 1) * 0.95
        lengths = np.maximum(parts.astype(np.int32), 2)
        ids = rng.integers(1, 50_000, int(lengths.sum())).astype(np.uint16)
        mask = (rng.random(len(ids)) < 0.6).astype(np.uint8)
        tokens.add_rows(ids, lengths, np.array([len(lengths)]))
        masks.add_rows(mask, lengths, np.array([len(lengths)]))
    tokens.commit(), masks.commit()
    return os.path.join(folder, "chat_00000")


class WithDenseMask(torch.utils.data.Dataset):
    """The samples of ``inner`` plus the ``[1, s, s]`` mask the loader built before."""

    def __init__(self, inner: PackedChatDataset):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict:
        sample = self.inner[index]
        seg = sample["segment_ids"].numpy()
        s = len(seg)
        cut = (seg[None, :] != seg[:, None]) | np.triu(np.ones((s, s), bool), 1)
        return {**sample, "attention_mask": torch.from_numpy(cut[None])}


def through_loader(dataset, rows: int) -> dict:
    """Bytes of one sample and rows/s through a one-worker DataLoader (first row not timed)."""
    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=1))
    first = next(loader)
    start = time.perf_counter()
    for _ in range(rows - 1):
        next(loader)
    seconds = time.perf_counter() - start
    return {"sample_bytes": sum(v.numel() * v.element_size() for v in first.values()),
            "rows_per_s": (rows - 1) / seconds}


def measure(s: int, rows: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        data = ChatRows([write_rows(folder, s, rows)])
        dataset = PackedChatDataset(data, data.rows[0], samples=rows, seq_length=s, pad_id=0,
                                    seed=1)
        now, before = through_loader(dataset, rows), through_loader(WithDenseMask(dataset), rows)
        segments = dataset[0]["segment_ids"][None]
        start = time.perf_counter()
        cut = attention_cut(segments)
        now["mask_on_device_s"] = time.perf_counter() - start
        now["mask_on_device_bytes"] = cut.numel() * cut.element_size()
    return {"seq_length": s, "now": now, "before": before,
            "bytes_ratio": before["sample_bytes"] / now["sample_bytes"],
            "throughput_ratio": now["rows_per_s"] / before["rows_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results = [measure(s, args.rows) for s in args.lengths]
    print(f"{'seq':>6} {'sample now':>12} {'before':>12} {'rows/s now':>11} {'before':>8} "
          f"{'x':>6} {'mask on device':>15}")
    for r in results:
        now, before = r["now"], r["before"]
        print(f"{r['seq_length']:>6} {now['sample_bytes'] / 2**20:>9.2f} MiB "
              f"{before['sample_bytes'] / 2**20:>9.1f} MiB {now['rows_per_s']:>11.1f} "
              f"{before['rows_per_s']:>8.2f} {r['throughput_ratio']:>6.1f} "
              f"{now['mask_on_device_s'] * 1e3:>9.0f} ms/row")
    if args.json:
        from launcher.plan.machine import cpu_info

        host = {"cpu": cpu_info().model, "cores": os.cpu_count(), "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"host": host, "rows": args.rows,
                                               "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
