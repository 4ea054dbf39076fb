"""Downstream tasks scored on the live model: :class:`DownstreamEval`, built once per rank by
:func:`build_downstream` and called by the training loop every ``eval.interval`` steps and
after the last one.

Every rank loads the same tasks and runs lm-evaluation-harness over them
(:mod:`launcher.evals.harness`), so every rank asks for the same rows in the same order. The
rows are sorted by length, packed several to a sequence (each attending to itself only) and
split over the data-parallel replicas in micro-batches sized to them
(:mod:`launcher.evals.rows`), each replica's micro-batches go through the engine at its
layout (:meth:`label_scores`: tensor- and
context-parallel ranks see the same batch, the last pipeline stage scores), and one all-reduce
over the world gives every rank every row's score. Every rank runs the same number of
micro-batches and collectives whatever its share, so none waits on a collective another rank
never makes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from launcher.config import DataConfig, EvalConfig
from launcher.evals.rows import (Packing, packing_of, replica_batches, row_length, score_plan,
                                 scored_rows)
from launcher.evals.tokenizer import TextTokenizer, eval_tokenizer_path
from launcher.runtime.eval_generation import generate_rows
from launcher.parallel import collectives


def score_rows(engine, rows, *, seq: int, micro_batch: int,
               packing: Packing = Packing()) -> list[tuple[float, bool]]:
    """(summed log-probability of each row's continuation, whether each of its tokens is the
    argmax), for every row, on every rank (collective over the world). The rows are packed
    several to a sequence as ``packing`` says, in micro-batches sized to them
    (:func:`launcher.evals.rows.score_plan`), the same shapes on every replica."""
    if not rows:
        return []
    dp_rank, dp = engine.data_parallel()
    plan = score_plan([row_length(c, x, seq) for c, x in rows], dp=dp, seq=seq,
                      micro_batch=micro_batch, packing=packing)
    scores = engine.label_scores([{k: torch.from_numpy(v) for k, v in b.items()}
                                  for b in replica_batches(rows, plan, dp_rank)])
    values = [0.0] * (2 * len(rows))
    for step, (logprob, misses) in zip(plan, scores or []):
        for j, row in enumerate(scored_rows(step, dp_rank)):
            values[2 * row] += float(logprob[j])
            values[2 * row + 1] += float(misses[j])
    totals = collectives.sum_floats(values)
    return [(totals[2 * i], totals[2 * i + 1] == 0.0) for i in range(len(rows))]


@dataclass
class DownstreamEval:
    """The tasks of one run and how to score them (see the module docstring)."""

    tasks: dict
    """{name: lm-evaluation-harness Task}."""
    score: Callable[[list], list]
    generate: Callable
    """(prompts, budgets, done) -> generated ids (eval_generation.generate_rows)."""
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eot: int
    seq: int
    interval: int
    at_end: bool
    limit: int
    contaminated: dict | None = None
    """{task: example indices found in the run's shards} (eval.contamination), or None: no
    clean-subset scores."""

    def due(self, step: int, last: bool) -> bool:
        return bool(self.interval and step % self.interval == 0) or (last and self.at_end)

    def table(self, samples: list | None = None) -> tuple[dict, int]:
        """({task: {metric: value}}, rows scored) (collective); ``samples`` gets every
        example's record (launcher.evals.harness.sample_records)."""
        from launcher.evals.harness import ScoredLM, run_tasks

        scored = []

        def counted(rows):
            scored.append(len(rows))
            return self.score(rows)

        lm = ScoredLM(self.encode, self.eot, self.seq, counted, self.generate, self.decode)
        return run_tasks(self.tasks, lm, self.limit, self.contaminated, samples), sum(scored)

    def __call__(self) -> dict:
        """{"eval/<task>/<metric>": value, ..., "eval/rows": rows scored, "eval/tasks_s":
        seconds} (collective)."""
        start = time.perf_counter()
        table, rows = self.table()
        flat = {f"eval/{task}/{metric}": value for task, row in table.items()
                for metric, value in row.items()}
        return {**flat, "eval/rows": rows, "eval/tasks_s": time.perf_counter() - start}


def rank_packing(cfg) -> Packing:
    """How this rank's engine takes scored rows packed (:func:`launcher.evals.rows.packing_of`:
    THD sequences where Transformer Engine's attention runs)."""
    from launcher.engines.model import use_transformer_engine

    return packing_of(cfg.eval, cfg.model, cp=cfg.parallelism.context_parallel_size,
                      te=use_transformer_engine())


def build_downstream(engine, *, ev: EvalConfig, data: DataConfig, seq: int, micro_batch: int,
                     packing: Packing = Packing(),
                     tokenizer: str | None = None) -> DownstreamEval | None:
    """The downstream evaluation of ``engine`` (anything with ``label_scores`` and
    ``data_parallel``; None without ``eval.tasks``); tasks and ``tokenizer`` (default: the
    run's) were checked before the ranks started (:func:`launcher.evals.check.eval_problems`)."""
    if not ev.tasks:
        return None
    from launcher.core.eval_tasks import load_tasks

    tokenizer = TextTokenizer(Path(tokenizer or eval_tokenizer_path(ev, data)))
    return DownstreamEval(
        tasks=load_tasks(ev.tasks, ev.include_path),
        score=lambda rows: score_rows(engine, rows, seq=seq, micro_batch=micro_batch,
                                      packing=packing),
        generate=lambda prompts, budgets, done: generate_rows(
            engine, prompts, budgets, done, seq=seq, micro_batch=micro_batch),
        encode=tokenizer.encode, decode=tokenizer.decode, eot=data.eod_token_id, seq=seq,
        interval=ev.interval, at_end=ev.at_end, limit=ev.limit,
        contaminated=dict(ev.contaminated) if ev.contamination else None)
