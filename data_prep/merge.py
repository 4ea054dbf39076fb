"""``python -m data_prep.merge <output dir>``: combine the manifests of a Slurm array's tasks.

Every task of ``num_tasks`` must have finished (``manifest.task-IIIII-of-NNNNN.json`` with
``"complete": true``) with the same tokenizer and dtype. The merge writes ``manifest.json`` and
``data.yaml`` listing every task's shards in task order, which is the input order. Tasks of
``format=chat`` are merged by :mod:`data_prep.chat_merge`.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time
from typing import List

import data_prep
from data_prep.data_config import data_config, write_data_config
from data_prep.errors import BadDataError, ConfigError, DataPrepError, no_documents_error
from data_prep.manifest import MANIFEST, load_manifest, write_manifest
from data_prep.output_lock import OutputLock, lock_name
from data_prep.stats import Stats

TASK_MANIFEST = re.compile(r"manifest\.task-(\d{5})-of-(\d{5})\.json$")


def task_manifests(out_dir: str) -> List[dict]:
    """The task manifests of ``out_dir`` in task order; ConfigError if any is missing or partial."""
    found = {}
    for path in glob.glob(os.path.join(glob.escape(out_dir), "manifest.task-*-of-*.json")):
        match = TASK_MANIFEST.search(os.path.basename(path))
        if match:
            found[(int(match.group(1)), int(match.group(2)))] = path
    if not found:
        raise ConfigError(f"{out_dir} has no manifest.task-*-of-*.json; run the array tasks first "
                          "(num_tasks=N task_index=I, or a Slurm array)")
    counts = {count for _, count in found}
    if len(counts) != 1:
        raise ConfigError(f"{out_dir} mixes task manifests of different num_tasks {sorted(counts)}")
    count = counts.pop()
    missing = [i for i in range(count) if (i, count) not in found]
    loaded = {i: load_manifest(found[(i, count)]) for i in range(count) if (i, count) in found}
    partial = [i for i, m in loaded.items() if not m or not m.get("complete")]
    if missing or partial:
        raise ConfigError(f"tasks not finished: missing {missing}, incomplete {partial} of {count}; "
                          "re-run those task indices, then merge again")
    return [loaded[i] for i in sorted(loaded)]


def _check_compatible(manifests: List[dict]) -> None:
    first = manifests[0]
    for m in manifests[1:]:
        for key in ("dtype", "eod_id", "bos_id", "name"):
            if m[key] != first[key]:
                raise BadDataError(f"task {m['task']['index']} has {key}={m[key]!r} but task 0 has "
                                   f"{first[key]!r}; all tasks must run with the same settings")
        if m["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            raise BadDataError(f"task {m['task']['index']} used another tokenizer file than task 0")


def merge_manifests(manifests: List[dict], limit: int = 5) -> dict:
    _check_compatible(manifests)
    totals = Stats()
    for m in manifests:
        for entry in m["shards"]:
            totals.merge(Stats.from_dict(entry["stats"]), limit)
        totals.merge(Stats.from_dict(m["trailing"]), limit)
    first = manifests[0]
    shards = [dict(entry, task=m["task"]["index"]) for m in manifests for entry in m["shards"]]
    return {"tool": "data_prep", "version": data_prep.__version__, "complete": True,
            "name": first["name"], "task": {"index": 0, "count": 1}, "merged_tasks": len(manifests),
            "wall_time_s": round(sum(m["wall_time_s"] for m in manifests), 3),
            "workers": first["workers"], "dtype": first["dtype"], "eod_id": first["eod_id"],
            "bos_id": first["bos_id"], "tokenizer": first["tokenizer"],
            "inputs": [f for m in manifests for f in m["inputs"]],
            "totals": dict(totals.to_dict(), shards=len(shards), bad_records=totals.bad,
                           records=totals.records),
            "trailing": Stats().to_dict(), "shards": shards, "merged_at": time.time()}


def merge(out_dir: str, split: str = "98,1,1") -> dict:
    """Write the combined manifest.json and data.yaml of ``out_dir``; returns the manifest.
    Holds the output's main lock (the one of a single run, which writes the same files)."""
    if not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir} is not a directory; name the output= of the array tasks")
    with OutputLock(out_dir, lock_name(1, 0)):
        return _merge_locked(out_dir, split)


def _merge_locked(out_dir: str, split: str) -> dict:
    manifests = task_manifests(out_dir)
    if any(m.get("format") == "chat" for m in manifests):
        return _merge_chat(out_dir, manifests, split)
    manifest = merge_manifests(manifests)
    if not manifest["shards"]:
        raise no_documents_error([f["path"] for f in manifest["inputs"]], manifest["totals"]["skipped"])
    write_manifest(os.path.join(out_dir, MANIFEST), manifest)
    write_data_config(out_dir, data_config(manifest["name"], out_dir, manifest["shards"], split,
                                           manifest["eod_id"], manifest["tokenizer"]["path"]))
    return manifest


def _merge_chat(out_dir: str, manifests: List[dict], split: str) -> dict:
    from data_prep.chat_merge import merge_chat_manifests
    from data_prep.chat_prep import no_conversation_error, write_chat_data_config

    manifest = merge_chat_manifests(manifests)
    if not manifest["shards"]:
        raise no_conversation_error(len(manifest["inputs"]), manifest["totals"])
    write_manifest(os.path.join(out_dir, MANIFEST), manifest)
    write_chat_data_config(out_dir, manifest, split)
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.merge", description=__doc__.split("\n")[0])
    parser.add_argument("output", help="the output directory the array tasks wrote into")
    parser.add_argument("--split", default="98,1,1", help="train,valid,test split for data.yaml")
    args = parser.parse_args(argv)
    try:
        manifest = merge(os.path.abspath(args.output), args.split)
    except DataPrepError as exc:
        print(f"data_prep.merge: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if manifest.get("format") == "chat":
        from data_prep.chat_prep import print_chat_summary as print_summary
    else:
        from data_prep.progress import print_summary
    print_summary(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
