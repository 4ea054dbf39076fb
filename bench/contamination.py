"""Throughput of ``data_prep.contamination``'s scan: shard tokens per second per core.

Writes a ``.bin`` of random token ids (uint32, a 128K vocabulary; ``--tokens`` of them, default
256M = 1 GiB) and hashes every window of it against the 8-grams of ``--examples`` task examples
of 40 tokens (default 10,000: 330,000 task n-grams), once per worker count, with the module's own
chunking and process pool (the fixed costs of a run, loading the tasks and the tokenizer, are
not in it). Prints tokens/s and tokens/s per worker, and the share of windows found (about 0:
the examples are random too).

    python bench/contamination.py [--tokens 268435456] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from data_prep import contamination as c  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 28)
    ap.add_argument("--examples", type=int, default=10_000)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--ngram", type=int, default=8)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="contam_bench_") as tmp:
        path = os.path.join(tmp, "shard.bin")
        step = 1 << 24
        with open(path, "wb") as f:
            for start in range(0, args.tokens, step):
                rng.integers(0, 128_256, min(step, args.tokens - start), dtype=np.uint32).tofile(f)
        examples = rng.integers(0, 128_256, (args.examples, 40), dtype=np.uint32)
        wanted = np.unique(np.concatenate([c.window_hashes(e, args.ngram) for e in examples]))
        dtype = np.dtype(np.uint32)
        items = [(path, dtype, s, s + c.CHUNK_TOKENS, args.ngram, wanted)
                 for s in range(0, args.tokens, c.CHUNK_TOKENS)]
        print(f"{args.tokens:,} tokens, {len(wanted):,} task {args.ngram}-grams, "
              f"{len(items)} chunks, {os.cpu_count()} cores")
        c.found_hashes(items[:1], 1)  # page cache and imports warm
        for workers in (int(w) for w in args.workers.split(",")):
            start = time.perf_counter()
            found = c.found_hashes(items, workers)
            seconds = time.perf_counter() - start
            print(f"workers={workers}: {seconds:.2f} s, {args.tokens / seconds / 1e6:.1f}M "
                  f"tokens/s, {args.tokens / seconds / workers / 1e6:.1f}M tokens/s per worker; "
                  f"{len(found)} task n-grams found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
