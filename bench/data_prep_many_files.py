"""data_prep over many small files against the same documents in one file, side by side.

A corpus of raw text is often a directory of one document per file (``text_unit=file``): a task
of a terabyte run can hold millions of them. What costs per file, not per byte (listing and
stat-ing the inputs, opening each one to read and to hash it, the manifest's list of inputs, which
is rewritten after every shard) must then stay small against the tokenizing.

Corpus: the running interpreter's standard-library sources as ``.txt`` files, ``--copies`` times
in as many directories (about 1,700 files and 31 MB a copy), and the same documents in one JSONL
file. Both go through ``python -m data_prep`` end to end (cl100k_base, ``--workers``), interleaved,
``--repeat`` times; printed for the best run of each: seconds, tokens/s, the ratio of the two, and
the manifest's timing (plan, tokenize, wait for hashes; CPU of the main process while tokenizing
and of the hashing). ``--previous DIR`` adds a previous data_prep tree on the same directory.

Usage: ``python bench/data_prep_many_files.py [--copies 8] [--repeat 3] [--workers 2]
[--previous DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def _scaling_bench():
    """bench/data_prep.py (its name is the package's, so it is loaded from its path)."""
    spec = importlib.util.spec_from_file_location("data_prep_bench", REPO / "bench" / "data_prep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_corpus(work: pathlib.Path, copies: int, sources: list) -> tuple:
    """(directory of .txt files, JSONL of the same documents in the same order, file count) of
    ``sources`` ((name, text) pairs), ``copies`` times."""
    directory, jsonl = work / "files", work / "one.jsonl"
    with open(jsonl, "w", encoding="utf-8") as handle:
        for copy in range(copies):
            sub = directory / f"{copy:04d}"
            sub.mkdir(parents=True)
            for index, (_, text) in enumerate(sources):
                (sub / f"{index:06d}.txt").write_text(text, encoding="utf-8")
                handle.write(json.dumps({"text": text}) + "\n")
    return directory, jsonl, copies * len(sources)


def _row(run: dict) -> str:
    timing = run["timing"]
    return (f"{run['seconds']:7.2f} s {run['tokens'] / run['seconds'] / 1e6:7.1f}M tok/s | plan "
            f"{timing.get('plan_s', 0):5.2f} s, tokenize {timing.get('tokenize_s', 0):5.2f} s, "
            f"hash wait {timing.get('hash_wait_s', 0):4.2f} s | CPU s: main while tokenizing "
            f"{timing.get('main_tokenize_cpu_s', 0):5.2f}, hashing {timing.get('hash_cpu_s', 0):5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--previous", default="", help="a tree holding a previous data_prep/")
    parser.add_argument("--work", default="", help="scratch directory (default: /dev/shm if present)")
    args = parser.parse_args()
    bench = _scaling_bench()
    base = args.work or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    work = pathlib.Path(tempfile.mkdtemp(prefix="data_prep_files_", dir=base))
    try:
        directory, jsonl, files = build_corpus(work, args.copies, bench.stdlib_sources())
        print(f"{files:,} files, {sum(p.stat().st_size for p in directory.rglob('*.txt')) / 1e6:,.1f} MB;"
              f" workers={args.workers}; best of {args.repeat}")
        rows = {"one JSONL file": (jsonl, ""), "many files": (directory, "")}
        if args.previous:
            rows["many files, previous"] = (directory, args.previous)
        runs = {name: [] for name in rows}
        for _ in range(args.repeat):
            for name, (path, tree) in rows.items():
                runs[name].append(bench.end_to_end(path, work / "out", args.workers, tree))
        best = {name: bench.best(found) for name, found in runs.items()}
        for name, run in best.items():
            print(f"{name:22s} {_row(run)}")
        ratio = best["many files"]["seconds"] / best["one JSONL file"]["seconds"]
        print(f"many files / one file: {ratio:.2f}x the time")
        if args.previous:
            print(f"previous / this version: "
                  f"{best['many files, previous']['seconds'] / best['many files']['seconds']:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
