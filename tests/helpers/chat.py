"""Conversations for the tests of ``format=chat``: synthetic conversations (``conversations``),
a byte-level BPE with chatml's role tokens (``chatml_tokenizer``), and chat shards written
directly (data_prep's ShardWriter, no tokenizer: rows of conversations of random ids and masks)
for the training tests on CPU (tests/test_chat_training.py) and on a GPU
(tests/test_gpu_chat_thd.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from tests.helpers.data_prep import train_hf_tokenizer

ROLE_TOKENS = ["<|im_start|>", "<|im_end|>"]
WORDS = "the cat sat on a mat while rain fell over quiet hills and rivers ran to the sea".split()


def chatml_tokenizer(directory: Path, vocab_size: int) -> Path:
    """``directory`` holding a BPE of ``vocab_size`` ids trained here plus chatml's role tokens
    (tokenizer.json) and ``<|endoftext|>`` as its eos (tokenizer_config.json)."""
    from tokenizers import Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(train_hf_tokenizer(directory, vocab_size)))
    tokenizer.add_special_tokens(ROLE_TOKENS)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversations(n: int, seed: int = 0) -> list:
    """``n`` records: every fifth a prompt/completion pair, the others 1-3 user/assistant turns
    (every other one after a system turn), replies of log-normal length."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 5 == 0:
            out.append({"prompt": sentence(rng, rng.randint(3, 20)),
                        "completion": f"answer {i}: " + sentence(rng, rng.randint(2, 40))})
            continue
        turns = [{"role": "system", "content": "be brief"}] if i % 2 else []
        for t in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": sentence(rng, rng.randint(2, 30))},
                      {"role": "assistant", "content": f"reply {i}.{t}: " +
                       sentence(rng, int(rng.lognormvariate(3, 0.8)) + 1)}]
        out.append({"messages": turns})
    return out


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
