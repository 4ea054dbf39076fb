"""One data_prep run (or one array task): plan, resume, tokenize, write shards and manifest."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import List, Optional

import numpy as np

import data_prep
from data_prep.assembler import ShardAssembler, total_stats
from data_prep.blocks import iter_blocks
from data_prep.data_config import data_config, write_data_config
from data_prep.errors import BadDataError, no_documents_error
from data_prep.input_hasher import InputHasher, hasher_count
from data_prep.inputs import check_unchanged, reporting_changed_inputs
from data_prep.manifest import kept_shards, load_manifest, resume_position, write_manifest
from data_prep.output_lock import OutputLock, lock_name
from data_prep.output_space import OutputSpace
from data_prep.pipeline import ordered_results, start_pool
from data_prep.plan import RunPlan, fingerprint, make_plan
from data_prep.progress import RunProgress
from data_prep.run_timing import RunTiming
from data_prep.stats import Stats
from data_prep.worker_process import peak_rss_bytes

RSS_BOUND_BASE, RSS_BOUND_PER_WORKER = 2 * 1024**3, 512 * 1024**2
"""The promised bound on the peak resident memory of a run's processes together."""


def memory_use(plan: RunPlan, pool, hasher: Optional[InputHasher]) -> dict:
    """Peak resident memory of this process, of every worker and of every hashing process (each
    process's own peak; their sum bounds the peak of the process tree), and the bound data_prep
    promises."""
    own = peak_rss_bytes()
    workers = sorted(pool.peak_rss.values()) if pool is not None else []
    hashers = sorted(hasher.peak_rss) if hasher is not None else []
    return {"peak_rss_bytes": own + sum(workers) + sum(hashers), "main_process_peak_rss_bytes": own,
            "worker_peak_rss_bytes": workers, "hasher_peak_rss_bytes": hashers,
            "rss_bound_bytes": RSS_BOUND_BASE + RSS_BOUND_PER_WORKER * plan.workers}


def input_entries(plan: RunPlan, digests: dict) -> List[dict]:
    """The manifest's ``inputs``: every input file with its sha256 ('' until it is known)."""
    return [{"path": f.path, "size": f.size, "format": f.format, "compression": f.compression,
             "sha256": digests.get(f.path, "")} for f in plan.files]


def build_manifest(plan: RunPlan, cfg, entries: List[dict], trailing: Stats, complete: bool,
                   wall: float, inputs: List[dict], identity: dict, memory: dict = None,
                   timing: dict = None) -> dict:
    """The manifest; ``inputs`` (input_entries) and ``identity`` (the fingerprint) are made once
    per run: with many input files they are most of a manifest, which is rewritten after every
    shard."""
    totals = total_stats(entries, trailing, cfg.examples_per_reason)
    return {"tool": "data_prep", "version": data_prep.__version__, "complete": complete,
            "name": plan.name, "task": {"index": plan.task_index, "count": plan.num_tasks},
            "wall_time_s": round(wall, 3), "workers": plan.workers, "memory": memory or {},
            "timing": timing or {},
            "dtype": np.dtype(plan.dtype).name, "eod_id": plan.info.eod_id if cfg.tokenizer.append_eod else -1,
            "bos_id": plan.info.bos_id if cfg.tokenizer.prepend_bos else -1,
            "tokenizer": plan.info.to_dict(), "inputs": inputs,
            "totals": dict(totals.to_dict(), shards=len(entries), bad_records=totals.bad,
                           records=totals.records),
            "trailing": trailing.to_dict(), "shards": entries, "fingerprint": identity}


def check_bad_fraction(manifest: dict, max_bad_fraction: float) -> None:
    totals = manifest["totals"]
    fraction = totals["bad_records"] / max(1, totals["records"])
    if fraction > max_bad_fraction:
        raise BadDataError(f"{totals['bad_records']} of {totals['records']} records were skipped "
                           f"({fraction:.2%} > max_bad_fraction={max_bad_fraction}); the output is "
                           "complete, but check the reasons above, or raise max_bad_fraction")


def finish_outputs(plan: RunPlan, cfg, manifest: dict) -> None:
    """Write the final manifest and (single task) the data config."""
    write_manifest(plan.manifest_path, manifest)
    if plan.num_tasks == 1:
        write_data_config(plan.out_dir, data_config(plan.name, plan.out_dir, manifest["shards"],
                                                    cfg.split, manifest["eod_id"], plan.info.path))


def _tokenize_all(plan: RunPlan, cfg, kept: List[dict], progress: RunProgress, started: float,
                  pool, space: OutputSpace, identity: dict) -> tuple:
    inputs = input_entries(plan, {})

    def on_commit(entries: List[dict]) -> None:
        write_manifest(plan.manifest_path, build_manifest(
            plan, cfg, entries, Stats(), False, time.perf_counter() - started, inputs, identity))
        space.committed(entries)

    resume = resume_position(kept)
    assembler = ShardAssembler(plan.out_dir, plan.stem, plan.dtype, (cfg.shard_tokens, cfg.shard_bytes),
                               cfg.examples_per_reason, kept, resume, on_commit, placer=pool)
    blocks = (b for b in iter_blocks(plan.files, cfg.text_key, str(cfg.text_unit),
                                     cfg.block_bytes) if b.index >= resume[0])
    remove_legacy_spool(plan.out_dir, plan.stem)
    try:
        for block, result in ordered_results(blocks, {resume[0]: resume[1]}, pool,
                                             (plan.info, plan.settings)):
            stats = assembler.consume(block, result)
            progress.advance(stats)
            space.observe(stats)
        trailing = assembler.finish()
    except BaseException:
        assembler.abort()
        raise
    return assembler.entries, trailing


def remove_legacy_spool(out_dir: str, stem: str) -> None:
    """Drop the token spool directory that data_prep versions before direct writes used; a run of
    one of them killed on this output left it behind."""
    shutil.rmtree(os.path.join(out_dir, f".data_prep-spool-{stem}"), ignore_errors=True)


def lock_output(plan: RunPlan) -> OutputLock:
    """Take the lock of this run's output part (says on stderr when it took over a stale one)."""
    os.makedirs(plan.out_dir, exist_ok=True)
    lock = OutputLock(plan.out_dir, lock_name(plan.num_tasks, plan.task_index))
    stale = lock.acquire()
    if stale:
        print(f"data_prep: warning: took over the lock of {stale}", file=sys.stderr)
    return lock


def start_hashing(files, workers: int, enabled: bool, hashers: list) -> None:
    """Start the sha256 of the inputs (``hash_inputs=true``): one process per WORKERS_PER_HASHER
    workers, each hashing whole files; appended to ``hashers``."""
    if enabled:
        sizes = {f.path: f.size for f in files}
        hashers.append(InputHasher(list(sizes), hasher_count(workers, len(sizes)), sizes).start())


def execute(cfg) -> dict:
    """Run (or resume) and return the final manifest; raises DataPrepError subclasses. The output
    part is locked (data_prep.output_lock) from before the first write until the end."""
    started, timing = time.perf_counter(), RunTiming()
    pool, lock, finished, hashers = None, None, False, []
    try:
        with timing.phase("plan"):
            plan = make_plan(cfg, on_inputs=lambda files, workers: start_hashing(
                files, workers, cfg.hash_inputs, hashers))
            pool = start_pool(plan.workers, plan.info)  # before any thread of this process starts
            lock = lock_output(plan)
        manifest = _execute_plan(cfg, plan, pool, hashers[0] if hashers else None, started, timing)
        finished = True
        return manifest
    finally:
        for hasher in hashers:
            hasher.stop()
        if pool is not None:
            pool.close(wait_for_exit=finished)
        if lock is not None:
            lock.release()


def _execute_plan(cfg, plan: RunPlan, pool, hasher: Optional[InputHasher], started: float,
                  timing: RunTiming) -> dict:
    with timing.phase("plan"):
        os.makedirs(plan.out_dir, exist_ok=True)
        previous = load_manifest(plan.manifest_path)
        identity = fingerprint(plan, cfg)
        kept = kept_shards(plan.out_dir, plan.stem, previous, identity, cfg.overwrite)
    if previous and previous.get("complete") and len(kept) == len(previous.get("shards", [])):
        finish_outputs(plan, cfg, previous)
        return previous
    kept_bytes = sum(Stats.from_dict(e["stats"]).input_bytes for e in kept)
    total_bytes = sum(f.size for f in plan.files)
    with RunProgress(total_bytes, kept_bytes, cfg.progress, cfg.progress_every_s) as progress, \
            timing.phase("tokenize"):
        space = OutputSpace(plan.out_dir, plan.stem, total_bytes, np.dtype(plan.dtype).itemsize,
                            kept_shards=len(kept), kept_input=kept_bytes, warn=progress.warn)
        with reporting_changed_inputs(plan.files), space.reporting_full_disk():
            entries, trailing = _tokenize_all(plan, cfg, kept, progress, started, pool, space,
                                              identity)
    digests = _wait_for_hashes(hasher, timing)
    check_unchanged(plan.files)  # what was read, and hashed, is what was listed
    if pool is not None:
        pool.close()
        timing.workers_reaped()
    if not entries and plan.num_tasks == 1:  # a shard is only started by a document
        raise no_documents_error([f.path for f in plan.files], trailing.counts)
    manifest = build_manifest(plan, cfg, entries, trailing, True, time.perf_counter() - started,
                              input_entries(plan, digests), identity,
                              memory_use(plan, pool, hasher), timing.to_dict())
    with space.reporting_full_disk():
        finish_outputs(plan, cfg, manifest)
    return manifest


def _wait_for_hashes(hasher: Optional[InputHasher], timing: RunTiming) -> dict:
    """{path: sha256} of the inputs ({} with hash_inputs=false), timing the wait for them."""
    if hasher is None:
        return {}
    with timing.phase("hash_wait"):
        digests = hasher.result()
    timing.hashers_reaped(hasher.processes)
    return digests
