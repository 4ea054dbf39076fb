"""The eval job of ``eval.asynchronous``: ``python -m launcher.evaluate checkpoint=<run dir>
eval.asynchronous=true``, started by :mod:`launcher.launch.eval_jobs`.

It holds the run's worker lock, scores every checkpoint the run asked for that has no scores
yet, oldest first, with one model built at the job's layout (each checkpoint's weights loaded
into it), and writes each result once (:mod:`launcher.evals.ledger`); a checkpoint that keep-k
removed before its turn (or that cannot be read) is skipped with an ``eval_skipped`` event. Then
it rescans, so a checkpoint asked for while it worked is not left behind. The scores reach
metrics.jsonl, wandb and TensorBoard through the live run (it merges every log interval), or,
when the run is not live, through this job: it takes the run's lock (role
:data:`launcher.core.locks.MERGE_ROLE`), merges and lets go.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import yaml

from launcher.config import EvalConfig
from launcher.core import locks
from launcher.evals import ledger
from launcher.launch.bootstrap import Rank, run_ranks
from launcher.runtime.metrics import append_event

OWN_FIELDS = ("asynchronous", "job_overrides", "output", "samples", "format", "rows", "tokens")
"""eval.* fields that are the eval job's own, never taken from the run's config."""
MERGE_WAIT_S = 600.0
"""How long a job whose run is live waits for the run to merge its scores (a run merges every
log interval and before it ends; a run that ends just after this job's look leaves the lock
free)."""


def run_config(run_dir: Path) -> dict:
    """The run's resolved config (config.yaml); {} when there is none."""
    try:
        return yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def with_run_eval(ev: EvalConfig, run_dir: Path, argv: Sequence[str]) -> EvalConfig:
    """``ev`` with the run's eval.* settings (tasks, include_path, limit, tokenizer, clean-subset
    ids, ...) for every field the command line does not set."""
    given = {a.lstrip("+~").split("=", 1)[0][len("eval."):] for a in argv
             if a.lstrip("+~").startswith("eval.")}
    saved = run_config(run_dir).get("eval") or {}
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    return dataclasses.replace(ev, **{k: v for k, v in saved.items()
                                      if k in names and k not in given and k not in OWN_FIELDS})


def checkpoint_scorer(cfg, tokenizer: str):
    """(the model chunks at this rank's layout, the downstream evaluation over them)."""
    from launcher.engines.megatron.engine import build_model_chunks
    from launcher.engines.megatron.scoring import ChunkScorer
    from launcher.runtime.evaluation import build_downstream, rank_packing

    chunks = build_model_chunks(cfg.model, cfg.parallelism, cfg.trainer)
    scorer = ChunkScorer(chunks, vocab_size=cfg.model.vocab_size)
    return chunks, build_downstream(scorer, ev=cfg.eval, data=cfg.data,
                                    seq=cfg.model.seq_length,
                                    micro_batch=cfg.trainer.micro_batch_size,
                                    packing=rank_packing(cfg), tokenizer=tokenizer)


def local_copy(checkpoint: str) -> tuple[str, str]:
    """('', a local step directory) for ``checkpoint``: itself, or for an s3:// step folder its
    copy in the cache, downloaded by the job's ranks together (collective); (why not, '') when
    it is not committed there any more (keep-k on the store) or cannot be read."""
    from launcher.core import objectstore, remote_checkpoints
    from launcher.core.errors import CheckpointError
    from launcher.launch.remote_inputs import RETRY_S, cache_of
    from launcher.parallel import collectives
    from launcher.runtime.checkpoint_store import fetch

    if not objectstore.is_remote(checkpoint):
        return "", checkpoint
    uri, commit, error = objectstore.ObjectURI.parse(checkpoint), None, ""
    if collectives.rank() == 0:
        try:
            commit = remote_checkpoints.read_commit(uri, time.monotonic() + RETRY_S)
            error = "" if commit is not None else "removed from the store before its turn (keep-k)"
        except CheckpointError as exc:
            error = f"unreadable: {exc}"
    commit, error = collectives.gather_objects((commit, error))[0]
    if error:
        return error, ""
    try:
        return "", str(fetch(commit, cache_of(uri), RETRY_S))
    except CheckpointError as exc:
        return f"unreadable: {exc}", ""


def load_weights(chunks, checkpoint: str) -> str:
    """Fill ``chunks`` from ``checkpoint`` (collective); '' when every rank did, else why not."""
    from launcher.core.checkpoints import COMPLETE
    from launcher.engines.weights.fill import fill_chunks
    from launcher.parallel import collectives

    error, local = local_copy(checkpoint)
    if not error and not (Path(local) / COMPLETE).is_file():
        error = "removed before its turn (keep-k)"
    if not error:
        try:
            fill_chunks(chunks, local)
        except Exception as exc:  # a checkpoint pruned while it was read, or a broken one
            error = ("removed while it was read (keep-k)" if not Path(local).exists()
                     else f"unreadable: {type(exc).__name__}: {exc}")
    failed = collectives.any_rank(bool(error))
    return (error or "failed on another rank") if failed else ""


def score_requests(rank: Rank, run_dir: Path, waiting: list, tokenizer: str) -> int:
    """Every waiting request scored (or skipped) in turn (collective); rank 0 writes."""
    from launcher.parallel import collectives

    chunks, downstream = checkpoint_scorer(rank.job.cfg, tokenizer)
    for request in waiting:
        start = time.perf_counter()
        why = load_weights(chunks, request["checkpoint"])
        if why and collectives.rank() == 0:
            ledger.write_skip(run_dir, request, why)
            append_event(run_dir, "eval_skipped", f"checkpoint step {request['step']} not "
                         f"scored: {why}", step=request["step"])
        if why:
            continue
        table, _ = downstream.table()
        if collectives.rank() != 0:
            continue
        seconds = round(time.perf_counter() - start, 3)
        ledger.write_result(run_dir, {**request, "tasks": table, "seconds": seconds})
        append_event(run_dir, "eval_job", f"checkpoint step {request['step']} scored in "
                     f"{seconds:.1f} s", step=request["step"], seconds=seconds)
    return 0


def merge_into_run(run_dir: Path) -> int:
    """Merge the scores waiting in ``run_dir`` (its lock held) through the run's logger (wandb
    resumed); how many."""
    from omegaconf import OmegaConf

    from launcher.config import LoggerConfig
    from launcher.runtime.eval_jobs import merge_results
    from launcher.runtime.metrics import MetricsLogger

    config = run_config(run_dir)
    logger = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LoggerConfig),
                                                 config.get("logger") or {}))
    metrics = MetricsLogger(run_dir, logger, Path(run_dir).name, config)
    try:
        merged = merge_results(run_dir, metrics)
    finally:
        metrics.close()
    return merged


def merge_when_free(run_dir: Path, on_merged: Callable[[Path], None],
                    wait_s: float = MERGE_WAIT_S) -> None:
    """Until nothing waits to be merged: merge under the run's lock when it is free (then
    ``on_merged``, e.g. the report rewritten), else give the live run time to merge (at most
    ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while ledger.unmerged(run_dir):
        try:
            locks.acquire(run_dir, role=locks.MERGE_ROLE)
        except locks.RunLocked:
            if time.monotonic() > deadline:
                print(f"evaluate: {run_dir} is still in use; its scores stay in "
                      f"{ledger.evals_dir(run_dir)} for the run to merge", file=sys.stderr)
                return
            time.sleep(1.0)
            continue
        try:
            print(f"evaluate: merged {merge_into_run(run_dir)} result(s) into {run_dir}",
                  file=sys.stderr, flush=True)
            on_merged(run_dir)
        finally:
            locks.release(run_dir)


def score_waiting(job, run_dir: Path, tokenizer: str,
                  on_merged: Callable[[Path], None]) -> int:
    """The eval job (module docstring); its exit code. ``on_merged``: after this job merged
    scores into the run (the run is not live)."""
    while True:
        with ledger.worker_lock(run_dir) as mine:
            if not mine:
                print("evaluate: another eval job is scoring this run's checkpoints; it takes "
                      "the waiting ones", file=sys.stderr)
                return 0
            waiting = ledger.pending(run_dir)
            if waiting:
                code = run_ranks(job, functools.partial(
                    score_requests, run_dir=run_dir, waiting=waiting, tokenizer=tokenizer),
                    command="evaluate")
                if code != 0:
                    return code
        merge_when_free(run_dir, on_merged)
        if not ledger.pending(run_dir):
            return 0
