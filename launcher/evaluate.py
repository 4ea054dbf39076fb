"""``python -m launcher.evaluate checkpoint=<dir> eval.tasks=[...] [eval.include_path=[...]]
[layout overrides] [eval.format=json]``

Scores a checkpoint on downstream tasks (lm-evaluation-harness's format, data on disk;
docs/eval.md): a trainwright run or step directory of either engine, or a Hugging Face
directory, at any layout its weights load into (``parallelism.*`` with
``cluster.gpus_per_node`` processes, e.g. TP=2 or PP=2 on two processes; the model comes from the
checkpoint). The tasks are encoded with ``eval.tokenizer``, else the checkpoint's own tokenizer
(its Hugging Face directory's, or the one its run's data was prepared with). Tasks, tokenizer
and data files are checked before any rank starts. ``eval.format=json`` prints one object:
``{"checkpoint": ..., "step": ..., "tasks": {task: {metric: value}}, "seconds": ...}``;
``eval.output=<file>`` also writes it there. For a run directory, the run's own ``eval.*``
settings (tasks, include path, limit, clean-subset ids) apply unless given here.
``eval.samples=<file.jsonl>`` also writes every example's scored requests (lm-evaluation-harness's
logged samples: task, doc_id, target, resps).
``checkpoint=<run dir> eval.asynchronous=true`` is the eval job of ``eval.asynchronous``
(:mod:`launcher.launch.eval_worker`): every checkpoint the run asked for and has no scores for,
scored once, merged into the run. Exit codes: 0 scored, 2 config error.
"""

from __future__ import annotations

RANK_MODULES = ("megatron.core.models.gpt", "lm_eval.evaluator", "launcher.evaluate",
                "launcher.launch.eval_worker", "launcher.engines.weights.fill",
                "launcher.runtime.evaluation", "scipy.io")
"""What an evaluating rank imports, imported for it before it starts
(:func:`launcher.launch.rank_preload.preload_rank_imports`). ``scipy.io``: every
``datasets.load_dataset`` imports it (the streaming patches of ``datasets.streaming``, datasets
5.2), about 0.4 s of each rank's start."""

if __name__ == "__main__":  # the server starts before this module's own imports (0.5 s)
    import sys as _sys

    if not {"-h", "--help"} & set(_sys.argv[1:]):
        from launcher.launch.rank_preload import preload_rank_imports as _preload

        _preload(RANK_MODULES)

import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from launcher.config import EvalFormat
from launcher.core.atomic import atomic_write_json, atomic_write_text
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.evals.check import eval_problems
from launcher.launch.agent import scheduler_exit
from launcher.launch.bootstrap import Rank, run_ranks
from launcher.launch.eval_worker import checkpoint_scorer, score_waiting, with_run_eval
from launcher.launch.job import prepare
from launcher.launch.model_source import adopt_model
from launcher.launch.rank_preload import preload_rank_imports
from launcher.launch.remote_inputs import localized


def split_checkpoint(argv: Sequence[str]) -> tuple[str, list]:
    """(the checkpoint=<dir> value, the other arguments)."""
    path, rest = "", []
    for arg in argv:
        if arg.startswith("checkpoint="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


def checkpoint_tokenizer(tokenizer: str, checkpoint: str) -> Optional[str]:
    """``eval.tokenizer``, else the Hugging Face directory's tokenizer.json, else the one kept
    in the checkpoint (from_hf's), else the tokenizer the checkpoint's run was prepared with;
    None when there is none."""
    from launcher.engines.weights.sources import SourceError, step_dir_of, step_tokenizer

    if tokenizer:
        return tokenizer
    if (Path(checkpoint) / "tokenizer.json").is_file():
        return str(Path(checkpoint) / "tokenizer.json")
    try:
        found = step_tokenizer(step_dir_of(Path(checkpoint)))
    except SourceError:
        return None
    return str(found) if found else None


def checkpoint_step(checkpoint: str) -> Optional[int]:
    from launcher.engines.weights.sources import SourceError, checkpoint_meta, step_dir_of

    try:
        return checkpoint_meta(step_dir_of(Path(checkpoint))).get("step")
    except SourceError:
        return None  # a Hugging Face directory


def evaluate_rank(rank: Rank, checkpoint: str, tokenizer: str) -> int:
    """The checkpoint's weights in this layout's model chunks, every task scored (collective);
    rank 0 prints."""
    from launcher.engines.weights.fill import fill_chunks
    from launcher.parallel import collectives

    cfg, start = rank.job.cfg, time.perf_counter()
    chunks, downstream = checkpoint_scorer(cfg, tokenizer)
    fill_chunks(chunks, checkpoint)
    samples: Optional[list] = [] if cfg.eval.samples else None
    table, _ = downstream.table(samples)
    if collectives.rank() == 0:
        if samples is not None:
            Path(cfg.eval.samples).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(cfg.eval.samples),
                              "".join(json.dumps(s) + "\n" for s in samples))
        report(table, checkpoint=checkpoint, ev=cfg.eval, out=rank.console.out,
               seconds=time.perf_counter() - start)
    return 0


def report(table: dict, *, checkpoint: str, ev, out, seconds: float) -> None:
    """The scores on ``out`` (eval.format) and, with eval.output, as JSON in that file."""
    record = {"checkpoint": checkpoint, "step": checkpoint_step(checkpoint), "tasks": table,
              "seconds": round(seconds, 3)}
    if ev.output:
        Path(ev.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(ev.output), record)
    if ev.format == EvalFormat.json:
        print(json.dumps(record), file=out, flush=True)
        return
    for task, row in table.items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), file=out,
              flush=True)


def rewrite_report(run_dir: Path) -> None:
    """A run that keeps an HTML report (run.report) gets it again with the merged scores."""
    from launcher.launch.eval_worker import run_config
    from launcher.reports.run import write_run_report

    if (run_config(run_dir).get("run") or {}).get("report"):
        print(f"[report] {write_run_report(run_dir)}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    preload_rank_imports(RANK_MODULES)
    checkpoint, rest = split_checkpoint(localized(argv, ("checkpoint",)))  # s3://: local copy
    if not checkpoint:
        print("evaluate: missing checkpoint=<run, step or Hugging Face directory>",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    job = prepare(adopt_model(rest, "checkpoint", path=checkpoint), plan=False)
    waiting = job.cfg.eval.asynchronous
    if waiting and not (Path(checkpoint) / "checkpoints").is_dir():
        print(f"evaluate: eval.asynchronous=true scores a run's waiting checkpoints; "
              f"checkpoint={checkpoint} is not a run directory (it has no checkpoints/)",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    if (Path(checkpoint) / "config.yaml").is_file():  # a run: its eval settings, unless given
        job = dataclasses.replace(job, cfg=dataclasses.replace(
            job.cfg, eval=with_run_eval(job.cfg.eval, Path(checkpoint), rest)))
    tokenizer = checkpoint_tokenizer(job.cfg.eval.tokenizer, checkpoint)
    problems = eval_problems(job.cfg, tokenizer)
    if not job.cfg.eval.tasks:
        problems.append("eval.tasks is empty; name the tasks to score, e.g. eval.tasks=[tw_facts]")
    if problems:
        print(f"evaluate: {len(problems)} problem(s):\n" + "\n".join(f"- {p}" for p in problems),
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    if waiting:
        return score_waiting(job, Path(checkpoint), tokenizer, on_merged=rewrite_report)
    return run_ranks(job, functools.partial(evaluate_rank, checkpoint=checkpoint,
                                            tokenizer=tokenizer), command="evaluate")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(scheduler_exit(main))
