"""Chat shards written directly (data_prep's ShardWriter, no tokenizer): rows of
conversations of random ids and masks, for the training tests of ``data.format=chat`` on CPU
(tests/test_chat_training.py) and on a GPU (tests/test_gpu_chat_thd.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_chat_shards(root: Path, rows: list, vocab: int = 512) -> Path:
    """Chat shards of ``rows`` (each a list of (ids, mask) conversations) and their data config."""
    from data_prep.shards import ShardWriter

    root.mkdir(parents=True, exist_ok=True)
    tokens, masks = ShardWriter(str(root), "chat_00000", np.uint16), \
        ShardWriter(str(root), "chat_00000.mask", np.uint8)
    for row in rows:
        lengths = np.array([len(ids) for ids, _ in row], dtype=np.int32)
        tokens.add_rows(np.concatenate([ids for ids, _ in row]), lengths, np.array([len(row)]))
        masks.add_rows(np.concatenate([m for _, m in row]), lengths, np.array([len(row)]))
    tokens.commit(), masks.commit()
    conf = root / "conf" / "data"
    conf.mkdir(parents=True)
    (conf / "chat.yaml").write_text(
        f"name: chat\nprefixes: ['{root / 'chat_00000'}']\nsplit: '100,0,0'\n"
        "eod_token_id: 0\nformat: chat\n")
    return root


def split_rows(seed: int = 0) -> list:
    """8 rows of 1-3 conversations of different lengths; row 5 has no target token at all."""
    rng, rows = np.random.default_rng(seed), []
    for r in range(8):
        row = []
        for _ in range(rng.integers(1, 4)):
            n = int(rng.integers(6, 20))
            mask = (rng.random(n) < 0.6).astype(np.uint8) * (r != 5)
            mask[0] = 0
            row.append((rng.integers(1, 512, n).astype(np.uint16), mask))
        rows.append(row)
    return rows
