"""``python -m data_prep.contamination shards=<data_prep output dir> eval.tasks=[...]
[eval.include_path=[...]] [ngram=8] [threshold=0.5] [workers=0] [format=text|json]``

How much of each evaluation task is in the training shards: token n-gram overlap (Llama 3's
8-grams by default) between every example of each task (lm-evaluation-harness task files,
:mod:`launcher.core.eval_tasks`; the text its ``doc_to_decontamination_query`` gives, else the
prompt and its answer) and the shards that ``data_prep`` wrote, encoded with the shards' own
tokenizer (their manifest's). An example is contaminated when at least ``threshold`` of its
n-grams occur somewhere in the shards; one shorter than ``ngram`` tokens is not judged.

The task side is small and the corpus is not: every task n-gram is hashed to 64 bits (a
polynomial hash over the token ids; a false match needs a collision among a few million
hashes, about 1e-7 at worst), kept as one sorted array, and the shards are streamed past it,
chunk by chunk on a process pool, each window's hash looked up with a binary search; memory is
that array plus one chunk per worker, whatever the corpus' size, and the time grows linearly with
it (docs/eval.md: throughput, and why no Bloom filter or suffix array of the corpus is built).

``format=json`` prints one object: ``{"ngram", "threshold", "tokens_scanned", "seconds",
"tasks": {task: {"examples", "contaminated", "share", "ids", "short"}}}`` (``ids``: the
contaminated examples' 0-based indices in the task's evaluation split). Exit codes: 0 done,
2 bad arguments, task or shards.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from launcher.core.exits import CONFIG_ERROR_EXIT

PRIME = np.uint64(0x100000001B3)
"""The hash's multiplier (FNV-1's 64-bit prime); arithmetic wraps modulo 2**64."""
CHUNK_TOKENS = 1 << 24
"""Tokens of a shard one worker hashes at a time (128 MiB of 64-bit hashes)."""
KEYS = {"shards", "eval.tasks", "eval.include_path", "ngram", "threshold", "workers", "format"}


@dataclass
class Options:
    shards: str = ""
    tasks: list = field(default_factory=list)
    include_path: list = field(default_factory=list)
    ngram: int = 8
    threshold: float = 0.5
    workers: int = 0
    format: str = "text"


def window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """The 64-bit hash of every window of ``n`` consecutive tokens (len - n + 1 of them)."""
    count = len(tokens) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    ids = tokens.astype(np.uint64)
    ids += np.uint64(1)
    hashes = ids[:count].copy()
    with np.errstate(over="ignore"):
        for k in range(1, n):
            hashes *= PRIME
            hashes += ids[k:k + count]
    return hashes


def scan_range(args: tuple) -> np.ndarray:
    """The task hashes found in tokens [start, stop) of one ``.bin`` (windows that begin there;
    the next n - 1 tokens read for the last ones)."""
    path, dtype, start, stop, n, wanted = args
    tokens = np.memmap(path, dtype=dtype, mode="r")
    hashes = window_hashes(np.asarray(tokens[start:min(len(tokens), stop + n - 1)]), n)
    hashes = hashes[prefilter(wanted)[(hashes >> SHIFT).astype(np.intp)]]
    where = np.searchsorted(wanted, hashes)
    where[where == len(wanted)] = 0
    return np.unique(hashes[wanted[where] == hashes])


SHIFT = np.uint64(64 - 24)
"""The top 24 bits of a hash index :func:`prefilter`'s table."""


def prefilter(wanted: np.ndarray) -> np.ndarray:
    """A table of 2**24 flags, set where some task hash has those top bits: one lookup in 16 MB
    drops almost every window (at 330,000 task n-grams, 2% pass on to the binary search)."""
    table = np.zeros(1 << 24, dtype=bool)
    table[(wanted >> SHIFT).astype(np.intp)] = True
    return table


def shard_ranges(out_dir: str, manifest: dict, n: int, wanted: np.ndarray) -> list:
    """One work item per chunk of every shard: (bin path, dtype, start, stop, n, wanted)."""
    items = []
    for shard in manifest["shards"]:
        path = os.path.join(out_dir, shard["prefix"] + ".bin")
        dtype = np.dtype(manifest["dtype"])
        tokens = os.path.getsize(path) // dtype.itemsize
        items += [(path, dtype, start, start + CHUNK_TOKENS, n, wanted)
                  for start in range(0, tokens, CHUNK_TOKENS)]
    return items


def found_hashes(items: list, workers: int) -> np.ndarray:
    """The union of :func:`scan_range` over ``items``, on ``workers`` processes (0: the cores)."""
    from data_prep.worker_pool import start_method

    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(items) == 1:
        parts = [scan_range(item) for item in items]
    else:
        with multiprocessing.get_context(start_method()).Pool(min(workers, len(items))) as pool:
            parts = pool.map(scan_range, items, chunksize=1)
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.uint64)


def example_text(task, doc) -> str:
    """What of an example is looked for: its decontamination query, else prompt + answer."""
    if task.should_decontaminate():
        return str(task.doc_to_decontamination_query(doc))
    target = task.doc_to_target(doc)
    choices = task.doc_to_choice(doc) if task.OUTPUT_TYPE == "multiple_choice" else None
    if choices is not None and isinstance(target, int):
        target = choices[target]
    return f"{task.doc_to_text(doc)} {target}"


def task_examples(tasks: dict, encoder) -> dict:
    """{task: [token ids of each example of its evaluation split]}."""
    out = {}
    for name, task in tasks.items():
        texts = [example_text(task, doc) for doc in task.eval_docs]
        flat, lengths = encoder.encode_batch(texts)
        out[name] = np.split(flat, np.cumsum(lengths)[:-1]) if len(texts) else []
    return out


def judge(examples: dict, found: np.ndarray, n: int, threshold: float) -> dict:
    """Per task: examples, contaminated (with ids), their share, and those too short to judge."""
    out = {}
    for name, rows in examples.items():
        ids, short = [], 0
        for index, tokens in enumerate(rows):
            hashes = window_hashes(tokens, n)
            if not len(hashes):
                short += 1
                continue
            if np.isin(hashes, found).mean() >= threshold:
                ids.append(index)
        out[name] = {"examples": len(rows), "contaminated": len(ids),
                     "share": len(ids) / len(rows) if rows else 0.0, "ids": ids, "short": short}
    return out


def contamination(opts: Options) -> dict:
    """The whole report (see the module docstring)."""
    from data_prep.inspect import read_manifest
    from data_prep.tokenizer_spec import TokenizerInfo, build_encoder
    from launcher.core.eval_tasks import load_tasks

    started = time.perf_counter()
    manifest = read_manifest(opts.shards)
    encoder = build_encoder(TokenizerInfo(**manifest["tokenizer"]), parallel=False)
    examples = task_examples(load_tasks(opts.tasks, opts.include_path), encoder)
    wanted = np.unique(np.concatenate([window_hashes(t, opts.ngram) for rows in
                                       examples.values() for t in rows] or [np.zeros(0, np.uint64)]))
    items = shard_ranges(opts.shards, manifest, opts.ngram, wanted)
    found = found_hashes(items, opts.workers) if len(wanted) else np.zeros(0, dtype=np.uint64)
    scanned = sum(os.path.getsize(i[0]) // i[1].itemsize for i in items if i[2] == 0)
    return {"ngram": opts.ngram, "threshold": opts.threshold, "tokens_scanned": scanned,
            "seconds": round(time.perf_counter() - started, 3),
            "tasks": judge(examples, found, opts.ngram, opts.threshold)}


def parse(argv: Sequence[str]) -> tuple[Options, list]:
    """(options, problems) of ``key=value`` arguments."""
    from omegaconf import OmegaConf

    problems = [f"{a!r} is not key=value" for a in argv if "=" not in a]
    unknown = sorted({a.split("=", 1)[0] for a in argv if "=" in a} - KEYS)
    problems += [f"unknown key {k}; use {', '.join(sorted(KEYS))}" for k in unknown]
    if problems:
        return Options(), problems
    conf = OmegaConf.to_container(OmegaConf.from_dotlist(list(argv)))
    ev = conf.get("eval") or {}
    listed = lambda v: list(v) if isinstance(v, (list, tuple)) else ([v] if v else [])  # noqa: E731
    opts = Options(shards=str(conf.get("shards") or ""), tasks=listed(ev.get("tasks")),
                   include_path=listed(ev.get("include_path")),
                   ngram=int(conf.get("ngram", 8)), threshold=float(conf.get("threshold", 0.5)),
                   workers=int(conf.get("workers", 0)), format=str(conf.get("format", "text")))
    return opts, check(opts)


def check(opts: Options) -> list:
    from launcher.core.eval_tasks import task_problems

    problems = []
    if not opts.shards or not os.path.isfile(os.path.join(opts.shards, "manifest.json")):
        problems.append(f"shards={opts.shards!r}: not a data_prep output directory (no "
                        "manifest.json); give the output= of a finished python -m data_prep run")
    if not opts.tasks:
        problems.append("eval.tasks is empty; name the tasks to check, e.g. eval.tasks=[tw_facts]")
    if opts.ngram < 1:
        problems.append(f"ngram={opts.ngram}: give a positive n (8 is Llama 3's)")
    if not 0 < opts.threshold <= 1:
        problems.append(f"threshold={opts.threshold}: give a share in (0, 1]")
    if opts.format not in ("text", "json"):
        problems.append(f"format={opts.format}: use text or json")
    return problems + task_problems(opts.tasks, opts.include_path)


def print_text(report: dict, out=sys.stdout) -> None:
    per_core = report["tokens_scanned"] / max(report["seconds"], 1e-9)
    print(f"{report['ngram']}-grams, contaminated at {report['threshold']:.0%} of an example's "
          f"n-grams; {report['tokens_scanned']:,} shard tokens in {report['seconds']:.2f} s "
          f"({per_core / 1e6:,.1f}M tokens/s)", file=out)
    for name, row in report["tasks"].items():
        ids = ", ".join(map(str, row["ids"][:20])) + (" ..." if len(row["ids"]) > 20 else "")
        print(f"{name}: {row['contaminated']} of {row['examples']} examples ({row['share']:.1%})"
              f"{'; ' + str(row['short']) + ' too short to judge' if row['short'] else ''}"
              f"{': ' + ids if ids else ''}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    import json

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    opts, problems = parse(argv)
    if problems:
        print(f"data_prep.contamination: {len(problems)} problem(s):\n"
              + "\n".join(f"- {p}" for p in problems), file=sys.stderr)
        return CONFIG_ERROR_EXIT
    report = contamination(opts)
    if opts.format == "json":
        print(json.dumps(report))
    else:
        print_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
