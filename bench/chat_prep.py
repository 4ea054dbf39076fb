"""Conversations into packed, masked shards: packing efficiency and ``data_prep format=chat``
throughput.

Part 1, packing alone (data_prep.packing, best-fit decreasing) on length mixes drawn here:
log-normal conversation lengths (medians 180 and 600 tokens, a long tail, cut at the row), rows of
2,049 / 4,097 / 8,193 tokens: efficiency (tokens / rows x row) against the bound (every row full),
and microseconds per conversation.

Part 1b, the same packing at ``chat.pack_multiple`` 4, 8, 16 (context parallelism 2, 4, 8):
each conversation at its length rounded up, in rows of seq_length, against 1.

Part 2, the whole command on ``--conversations`` synthetic multi-turn conversations (JSONL, the
chatml template, a byte-level BPE of 4,000 ids trained here) at each ``--workers``: conversations
and tokens per second, and per worker, from the command's start to its exit.

    python bench/chat_prep.py [--conversations 40000] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from data_prep.packing import best_fit_decreasing  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from it an be this are which or his "
         "had not but were have they one all their has there been its more when who will no if "
         "out so said what up about into than them can only other new some could time these two "
         "may then do first any my now such like our over man me even most made after also did "
         "many before must through back years where much your way well down should because each "
         "just those people how too little state good very make world still own see men work "
         "long get here between both life being under never day same another know while last")


def packing_table() -> None:
    print("| median tokens | row tokens | conversations | efficiency | bound | us per conversation |")
    print("|---|---|---|---|---|---|")
    for median, row in ((180, 2049), (180, 4097), (600, 4097), (600, 8193)):
        rng = random.Random(0)
        mu = __import__("math").log(median)
        lengths = [max(8, min(row, int(rng.lognormvariate(mu, 0.9)))) for _ in range(200_000)]
        start = time.perf_counter()
        packing = best_fit_decreasing(lengths, row)
        seconds = time.perf_counter() - start
        bound = sum(lengths) / (row * -(-sum(lengths) // row))
        print(f"| {median} | {row:,} | {len(lengths):,} | {packing.efficiency:.4%} | "
              f"{bound:.4%} | {seconds / len(lengths) * 1e6:.1f} |")


def multiple_table() -> None:
    """Rows packed at a multiple (``chat.pack_multiple``, for context parallelism): each
    conversation takes its length rounded up, in rows of seq_length; the efficiency counted
    over the trained row (seq_length + 1), as the manifest counts it."""
    print("| median tokens | seq_length | pack_multiple | efficiency |")
    print("|---|---|---|---|")
    for median, seq in ((180, 4096), (600, 8192)):
        rng = random.Random(0)
        mu = __import__("math").log(median)
        lengths = [max(8, min(seq, int(rng.lognormvariate(mu, 0.9)))) for _ in range(200_000)]
        for multiple in (1, 4, 8, 16):
            room = seq + 1 if multiple == 1 else seq
            rows = best_fit_decreasing([-(-n // multiple) * multiple for n in lengths], room).rows
            print(f"| {median} | {seq:,} | {multiple} | "
                  f"{sum(lengths) / (len(rows) * (seq + 1)):.4%} |")


def synthetic(path: Path, n: int) -> None:
    rng, words = random.Random(1), WORDS.split()
    with open(path, "w") as out:
        for i in range(n):
            turns = []
            for _ in range(rng.randint(1, 4)):
                turns.append({"role": "user", "content": " ".join(
                    rng.choice(words) for _ in range(rng.randint(5, 60)))})
                turns.append({"role": "assistant", "content": " ".join(
                    rng.choice(words) for _ in range(int(rng.lognormvariate(4, 0.8)) + 1))})
            out.write(json.dumps({"messages": turns}) + "\n")


def tokenizer(root: Path) -> Path:
    from tokenizers import Tokenizer

    from tests.helpers.data_prep import train_hf_tokenizer

    tok = Tokenizer.from_file(str(train_hf_tokenizer(root, 4000)))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return root


def command_table(n: int, workers: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        synthetic(tmp / "in" / "c.jsonl", n)
        tok = tokenizer(tmp)
        print("\n| workers | conversations/s | tokens/s | tokens/s per worker | packing |")
        print("|---|---|---|---|---|")
        for w in workers:
            out = tmp / f"out{w}"
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "data_prep", f"input={tmp / 'in'}",
                            f"output={out}", "format=chat", "tokenizer.kind=hf",
                            f"tokenizer.path={tok}", "chat.template=chatml", "seq_length=4096",
                            f"workers={w}", "progress=false"], check=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
            seconds = time.perf_counter() - start
            m = json.loads((out / "manifest.json").read_text())
            tokens = m["totals"]["tokens"]
            print(f"| {w} | {n / seconds:,.0f} | {tokens / seconds:,.0f} | "
                  f"{tokens / seconds / w:,.0f} | {m['chat']['packing_efficiency']:.4%} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=40_000)
    ap.add_argument("--workers", default="1,2")
    args = ap.parse_args()
    packing_table()
    multiple_table()
    command_table(args.conversations, [int(w) for w in args.workers.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
