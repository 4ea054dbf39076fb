"""Checkpoint evaluations in their own jobs (``eval.asynchronous``), the run's side.

The training's rank 0 asks for every checkpoint it completes to be scored (a request in
``<run>/evals/``, :mod:`launcher.evals.ledger`) and has the run's launch path start an eval job
(``dispatch``, from :mod:`launcher.launch.eval_jobs`); it never waits for one. Every
``trainer.log_interval`` steps and before the run lets go of its directory, it merges the scores
that came back into metrics.jsonl, wandb and TensorBoard (:func:`merge_results`); scores that
come back after the run ended are merged by their eval job, under the run's lock. Other ranks get
:class:`NullEvalJobs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from launcher.core.checkpoints import complete_steps, read_meta
from launcher.evals import ledger

X_KEY = "eval/tokens"
"""What a merged score is charted against (wandb's step_metric)."""


def result_metrics(record: dict) -> dict:
    """A result as metric keys: ``eval/<task>/<metric>``, the tokens it was trained on, the
    checkpoint step and the job's seconds."""
    flat = {f"eval/{task}/{metric}": value for task, row in record["tasks"].items()
            for metric, value in row.items()}
    return {**flat, X_KEY: record["tokens"], ledger.ASYNC_KEY: record["step"],
            "eval/job_s": record.get("seconds", 0.0)}


def merge_results(run_dir: Path, metrics, already: Optional[set] = None) -> int:
    """Log every score not yet merged (its checkpoint's step, :meth:`log_late`), then mark it;
    ``already``: steps found in metrics.jsonl (default: read now). The caller holds the run's
    lock. Returns how many were merged."""
    already = ledger.merged_in_metrics(run_dir) if already is None else already
    merged = 0
    for record in ledger.unmerged(run_dir):
        if record["step"] not in already:
            metrics.log_late(record["step"], result_metrics(record), X_KEY)
            already.add(record["step"])
            merged += 1
        ledger.mark_merged(run_dir, record["step"])
    return merged


class NullEvalJobs:
    """Ranks other than 0, and runs without eval.asynchronous: nothing to ask for or merge."""

    def saved(self, step_dir: Path, step: int, checkpoint: str = "") -> None:
        """Do nothing."""

    def catch_up(self) -> None:
        """Do nothing."""

    def merge(self) -> None:
        """Do nothing."""


class EvalJobs(NullEvalJobs):
    """Rank 0's requests and merges (module docstring)."""

    def __init__(self, run_dir: Path, metrics, *, seq_length: int,
                 dispatch: Callable[[], str]):
        self.run_dir, self.metrics, self.seq_length = Path(run_dir), metrics, seq_length
        self.dispatch = dispatch
        self._merged = ledger.merged_in_metrics(self.run_dir)

    def _request(self, step_dir: Path, checkpoint: str = "") -> bool:
        meta = read_meta(step_dir)
        if "step" not in meta:
            return False
        return ledger.request(self.run_dir, step=int(meta["step"]),
                              checkpoint=checkpoint or step_dir,
                              tokens=int(meta.get("consumed_samples", 0)) * self.seq_length)

    def saved(self, step_dir: Path, step: int, checkpoint: str = "") -> None:
        """Checkpoint ``step`` is complete (``step_dir``: a local copy, read now;
        ``checkpoint``: where the eval job loads it, when not there: its s3:// step folder): ask
        for its scores and start an eval job."""
        if self._request(step_dir, checkpoint):
            self._start(f"checkpoint step {step}")

    def catch_up(self) -> None:
        """At start: ask for every complete checkpoint not asked for yet (a crash between its
        completion and its request, or eval.asynchronous newly set), and start an eval job when
        any request is waiting (one killed with an earlier launch, say)."""
        for step_dir in complete_steps(self.run_dir / "checkpoints"):
            self._request(step_dir)
        waiting = ledger.pending(self.run_dir)
        if waiting:
            self._start(f"{len(waiting)} checkpoint(s) waiting, the first step "
                        f"{waiting[0]['step']}")
        self.merge()

    def _start(self, what: str) -> None:
        try:
            how = self.dispatch()
        except Exception as exc:  # an eval job is never worth stopping the training for
            self.metrics.log_event("eval_job", f"{what}: the eval job did not start: "
                                   f"{type(exc).__name__}: {exc}; the next checkpoint (or "
                                   "launch) starts one for every waiting checkpoint")
            return
        self.metrics.log_event("eval_job", f"{what}: scored by {how}", echo=False)

    def merge(self) -> None:
        """Merge the scores that came back (rank 0 holds the run's lock)."""
        merge_results(self.run_dir, self.metrics, self._merged)


def make_eval_jobs(rank: int, *, run_dir: Path, metrics, asynchronous: bool, seq_length: int,
                   dispatch: Callable[[], str]) -> NullEvalJobs:
    """:class:`EvalJobs` on rank 0 with eval.asynchronous, else :class:`NullEvalJobs`."""
    if rank != 0 or not asynchronous:
        return NullEvalJobs()
    return EvalJobs(run_dir, metrics, seq_length=seq_length, dispatch=dispatch)
