"""``eval.contamination=true``, once per job before any rank starts: :func:`with_contamination`.

Runs ``python -m data_prep.contamination`` (a command: launcher does not import data_prep) on
every data_prep output folder the run's ``data.prefixes`` lie in, and puts the contaminated
examples of each task (the union over the folders) into ``eval.contaminated``, which every rank
uses for the clean-subset scores and ``config.yaml`` records. A result is cached in
``<shards>/contamination/<key>.json``, the key hashing the shards' manifest, the tasks' files
(YAML and data) and the n-gram settings, so a requeued or resumed run does not scan again; a
folder that cannot be written to is scanned every time (said once).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from launcher.config import EvalConfig, TrainwrightConfig
from launcher.core.atomic import atomic_write_json
from launcher.core.exits import CONFIG_ERROR_EXIT


def shard_dirs(prefixes) -> list[Path]:
    """The data_prep output folders (with a manifest.json) of ``prefixes``, in order."""
    out = []
    for prefix in prefixes:
        folder = Path(prefix).parent
        if (folder / "manifest.json").is_file() and folder not in out:
            out.append(folder)
    return out


def task_files(ev: EvalConfig) -> list[Path]:
    """Every file the tasks are read from: their YAML and their data."""
    from launcher.core.eval_tasks import data_files, task_manager

    manager, files = task_manager(ev.include_path), []
    for name in ev.tasks:
        entry = manager.task_index[name]
        files += [Path(entry.yaml_path), *data_files(entry.cfg or {}, Path(entry.yaml_path).parent)]
    return files


def cache_key(folder: Path, ev: EvalConfig) -> str:
    digest = hashlib.sha256((folder / "manifest.json").read_bytes())
    for path in task_files(ev):
        digest.update(str(path).encode() + b"\0" + path.read_bytes())
    digest.update(json.dumps([sorted(ev.tasks), ev.ngram, ev.threshold]).encode())
    return digest.hexdigest()[:16]


def scan(folder: Path, ev: EvalConfig) -> dict:
    """data_prep.contamination's JSON report for ``folder`` (exit 2 with its message if it
    fails)."""
    cmd = [sys.executable, "-m", "data_prep.contamination", f"shards={folder}",
           f"eval.tasks=[{','.join(ev.tasks)}]", f"ngram={ev.ngram}",
           f"threshold={ev.threshold}", "format=json"]
    if ev.include_path:
        cmd.append(f"eval.include_path=[{','.join(ev.include_path)}]")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"eval.contamination: {proc.stderr.strip()}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    return json.loads(proc.stdout)


def report_of(folder: Path, ev: EvalConfig) -> dict:
    cache = folder / "contamination" / f"{cache_key(folder, ev)}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    report = scan(folder, ev)
    try:
        cache.parent.mkdir(exist_ok=True)
        atomic_write_json(cache, report)
    except OSError as exc:
        print(f"eval.contamination: not cached ({exc}); the next launch scans again",
              file=sys.stderr)
    return report


def with_contamination(cfg: TrainwrightConfig) -> TrainwrightConfig:
    """``cfg`` with ``eval.contaminated`` found (see the module docstring)."""
    ev = cfg.eval
    if not (ev.contamination and ev.tasks):
        return cfg
    folders = shard_dirs(cfg.data.prefixes)
    if not folders:
        print("eval.contamination needs the run's shards: data.prefixes written by data_prep "
              "(a manifest.json beside them); mock data has none. Set eval.contamination=false "
              "or train on data_prep shards", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    found: dict = {task: set() for task in ev.tasks}
    for folder in folders:
        for task, row in report_of(folder, ev)["tasks"].items():
            found[task] |= set(row["ids"])
    summary = ", ".join(f"{t} {len(ids)}" for t, ids in found.items())
    print(f"eval.contamination: examples found in the shards ({ev.ngram}-grams, "
          f"{ev.threshold:.0%}): {summary}", file=sys.stderr, flush=True)
    contaminated = {task: sorted(ids) for task, ids in found.items()}
    return dataclasses.replace(cfg, eval=dataclasses.replace(ev, contaminated=contaminated))
