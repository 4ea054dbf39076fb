"""``python -m data_prep.inspect <output dir>``: verify the shards, then show totals, dtype, length
histogram and decoded samples.

Every shard's ``.bin`` and ``.idx`` are first checked against the sizes and CRC-32 recorded in the
manifest (``--no-verify`` skips that, ``--verify-only`` does nothing else); a mismatch exits 3
naming the file. Shards are then read with Megatron-Core's own ``IndexedDataset``, so what is
shown is what training reads.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

import numpy as np

from data_prep.manifest import MANIFEST, load_manifest, shard_problem
from data_prep.tokenizer_spec import TokenizerInfo, build_encoder
from launcher.core.exits import BAD_DATA_EXIT


def open_shards(out_dir: str, manifest: dict) -> list:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return [IndexedDataset(os.path.join(out_dir, s["prefix"]), mmap=True) for s in manifest["shards"]]


def length_histogram(lengths: np.ndarray) -> List[str]:
    """Rows 'lo-hi tokens | count | bar' over power-of-two bins."""
    if len(lengths) == 0:
        return ["(no documents)"]
    edges = 2 ** np.arange(0, int(np.ceil(np.log2(max(2, lengths.max())))) + 2)
    counts, _ = np.histogram(lengths, bins=edges)
    width = max(counts.max(), 1)
    return [f"{edges[i]:>9,}-{edges[i + 1] - 1:<9,} {c:>9,} {'#' * int(40 * c / width)}"
            for i, c in enumerate(counts) if c]


def decode_document(encoder, ids: np.ndarray, specials: set, max_chars: int) -> str:
    text = encoder.decode([int(i) for i in ids if int(i) not in specials])
    return text if len(text) <= max_chars else text[:max_chars] + f" ... [{len(text) - max_chars} more chars]"


def _document_refs(datasets: list) -> List[tuple]:
    return [(d, i) for d in datasets for i in range(len(d))]


def verify_shards(out_dir: str, manifest: dict) -> List[str]:
    """The problems (one per damaged shard, naming the file) of the manifest's shards; [] = all OK."""
    return [p for p in (shard_problem(out_dir, entry) for entry in manifest["shards"]) if p]


def check_shards(out_dir: str, stream=sys.stdout) -> bool:
    """Verify every shard; print OK with the count, or each damaged file on stderr. True = all OK."""
    manifest = read_manifest(out_dir)
    problems = verify_shards(out_dir, manifest)
    for problem in problems:
        print(f"data_prep.inspect: error: damaged shard {problem}", file=sys.stderr)
    if problems:
        print(f"data_prep.inspect: {len(problems)} of {len(manifest['shards'])} shard(s) do not match "
              "the manifest; re-run the python -m data_prep command that wrote them (it redoes "
              "damaged shards; for an array: that task, then data_prep.merge)", file=sys.stderr)
        return False
    print(f"verified {len(manifest['shards'])} shard(s): sizes and CRC-32 match the manifest: OK",
          file=stream)
    return True


def read_manifest(out_dir: str) -> dict:
    manifest = load_manifest(os.path.join(out_dir, MANIFEST))
    if manifest is None:
        raise SystemExit(f"{out_dir}: no {MANIFEST}; run python -m data_prep (or data_prep.merge) first")
    return manifest


def report(out_dir: str, first: int, random: int, seed: int, max_chars: int, stream=sys.stdout) -> None:
    manifest = read_manifest(out_dir)
    datasets = open_shards(out_dir, manifest)
    lengths = np.concatenate([d.sequence_lengths for d in datasets]) if datasets else np.zeros(0, int)
    totals = manifest["totals"]
    print(f"{out_dir}: {totals['documents']:,} documents, {totals['tokens']:,} tokens, "
          f"{len(datasets)} shard(s), dtype {manifest['dtype']}, EOD {manifest['eod_id']}, "
          f"tokenizer {manifest['tokenizer']['kind']} {manifest['tokenizer']['path']}", file=stream)
    if len(lengths):
        print(f"document length (tokens): min {lengths.min():,}  median {int(np.median(lengths)):,}  "
              f"mean {lengths.mean():,.1f}  max {lengths.max():,}", file=stream)
    print("length histogram (tokens, documents):", file=stream)
    for row in length_histogram(lengths):
        print("  " + row, file=stream)
    encoder = build_encoder(TokenizerInfo(**manifest["tokenizer"]), parallel=False)
    specials = {manifest["eod_id"], manifest["bos_id"]} - {-1}
    refs = _document_refs(datasets)
    picks = [("first", r) for r in refs[:first]]
    if refs and random:
        chosen = np.random.default_rng(seed).choice(len(refs), size=min(random, len(refs)), replace=False)
        picks += [("random", refs[int(i)]) for i in sorted(chosen)]
    for label, (dataset, index) in picks:
        print(f"--- {label} document {index} of {os.path.basename(dataset.path_prefix)} "
              f"({len(dataset[index])} tokens) ---", file=stream)
        print(decode_document(encoder, dataset[index], specials, max_chars), file=stream)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.inspect",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("output", help="a data_prep output directory (with manifest.json)")
    parser.add_argument("--first", type=int, default=2, help="decode this many first documents")
    parser.add_argument("--random", type=int, default=2, help="decode this many random documents")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random pick")
    parser.add_argument("--max-chars", type=int, default=400, help="cut decoded text after this")
    checks = parser.add_mutually_exclusive_group()
    checks.add_argument("--no-verify", action="store_true", help="skip the CRC-32 check of the shards")
    checks.add_argument("--verify-only", action="store_true", help="only check the shards' CRC-32 (exit 3 "
                        "on a mismatch), without reading or decoding documents")
    args = parser.parse_args(argv)
    out_dir = os.path.abspath(args.output)
    if not args.no_verify and not check_shards(out_dir):
        return BAD_DATA_EXIT
    if args.verify_only:
        return 0
    report(out_dir, args.first, args.random, args.seed, args.max_chars)
    return 0


if __name__ == "__main__":
    sys.exit(main())
