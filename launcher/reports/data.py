"""A run directory read back for a report: :func:`load_run` -> :class:`RunData`.

Everything comes from the files a run writes (metrics.jsonl, events.jsonl, plan.json,
config.yaml, env.json) and the goodput account (:mod:`launcher.runtime.goodput`), so a report
can be made of a copied run directory, by anyone, after the fact. A line cut by a crash is
skipped. :func:`outcome` says how the run ended: ``finished``, ``stopped`` (saved for a
requeue), ``failed`` (with the cause) or ``running`` (no end recorded yet).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from launcher.core.exits import REQUEUE_EXIT
from launcher.core.jsonl import read_jsonl
from launcher.runtime.goodput import account

RUN_END = "run_end"
"""The event the launching process writes when a run ends (its exit code and outcome)."""


@dataclass(frozen=True)
class Outcome:
    kind: str
    """finished, stopped, failed or running."""
    text: str
    """One line: how the run ended and why."""


@dataclass
class RunData:
    """What a run report shows, read from ``run_dir``."""

    run_dir: Path
    steps: list = field(default_factory=list)
    """metrics.jsonl step lines (those with ``loss``) by step, the last line of each step (a
    step recomputed after a restart counts as the later attempt logged it)."""
    discarded: list = field(default_factory=list)
    """Step lines a later attempt logged again (work thrown away by a restart), in file order."""
    evals: list = field(default_factory=list)
    """metrics.jsonl evaluation lines (``eval/loss``)."""
    tasks: list = field(default_factory=list)
    """metrics.jsonl downstream-task lines (``eval/tokens`` and ``eval/<task>/<metric>``), one
    per step (the last, when a restart scored a step again), by step."""
    events: list = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    config_text: str = ""
    """config.yaml as written (already redacted)."""
    env: dict = field(default_factory=dict)
    goodput: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def last_step(self) -> int:
        return max((row["step"] for row in self.steps), default=0)

    @property
    def tokens_per_step(self) -> int:
        return int(self.plan.get("global_batch_tokens") or 0)

    def command(self) -> str:
        """The command that reproduces the run (its argv, secrets already redacted)."""
        argv = list(self.env.get("argv") or [])
        if not argv:
            return ""
        args = argv[1:] if argv[0].endswith(".py") or argv[0] == "-m" else argv
        return "python -m launcher.train " + " ".join(shlex.quote(a) for a in args)


def load_run(run_dir: Path) -> RunData:
    """Read ``run_dir`` (a run directory: metrics.jsonl and/or events.jsonl)."""
    run_dir = Path(run_dir)
    data, by_step, scored = RunData(run_dir), {}, {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        if "loss" in row and "step" in row:
            if row["step"] in by_step:
                data.discarded.append(by_step[row["step"]])
            by_step[row["step"]] = row
        elif "eval/loss" in row:
            data.evals.append(row)
        elif "eval/tokens" in row and "step" in row:
            scored[row["step"]] = row
    data.steps = [by_step[step] for step in sorted(by_step)]
    data.tasks = [scored[step] for step in sorted(scored)]
    data.events = read_jsonl(run_dir / "events.jsonl")
    for name, attr in (("plan.json", "plan"), ("env.json", "env")):
        try:
            setattr(data, attr, json.loads((run_dir / name).read_text()))
        except (OSError, ValueError):
            pass
    try:
        data.config_text = (run_dir / "config.yaml").read_text()
    except OSError:
        pass
    data.goodput = account(run_dir)
    return data


def outcome(run: RunData) -> Outcome:
    """How ``run`` ended: the launcher's ``run_end`` event when there is one, else what the
    events and metrics show."""
    ends = [e for e in run.events if e.get("kind") == RUN_END]
    if ends:
        return Outcome(ends[-1].get("outcome", "failed"), ends[-1].get("message", ""))
    aborts = [e for e in run.events if e.get("kind") == "abort"]
    if aborts:
        return Outcome("failed", aborts[-1].get("message", "aborted"))
    attempts = [e for e in run.events if e.get("kind") == "attempt_end"]
    if attempts and not attempts[-1].get("restart"):
        cause = attempts[-1].get("message", "").split(": ", 1)[-1]
        if cause == "finished":
            return Outcome("finished", f"finished at step {run.last_step}")
        if f"code {REQUEUE_EXIT}" in cause:
            return Outcome("stopped", f"stopped for requeue at step {run.last_step}")
        return Outcome("failed", cause)
    train_steps = run.plan.get("train_steps")
    if train_steps and run.last_step >= train_steps:
        return Outcome("finished", f"finished at step {run.last_step}")
    return Outcome("running", f"no end recorded; last step {run.last_step}")


def _cause(events: list) -> str:
    """The last failure recorded: an abort's message, else the last attempt's cause."""
    for event in reversed(events):
        if event.get("kind") == "abort":
            return event.get("message", "")
        if event.get("kind") == "attempt_end":
            cause = event.get("message", "").split(": ", 1)[-1]
            if cause != "finished":
                return cause
    return ""


def record_end(run_dir: Path, code: Optional[int]) -> Outcome:
    """Append the ``run_end`` event of a run that ended with exit ``code`` (the launching
    process calls it once, however the run ended); its outcome."""
    from launcher.runtime.metrics import append_event

    run = RunData(Path(run_dir), events=read_jsonl(Path(run_dir) / "events.jsonl"))
    steps = [r.get("step", 0) for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]
    last = max(steps, default=0)
    if code == 0:
        end = Outcome("finished", f"finished at step {last}")
    elif code == REQUEUE_EXIT:
        end = Outcome("stopped", f"stopped for requeue at step {last} (exit {REQUEUE_EXIT}); "
                                 "the same command resumes it")
    else:
        cause = _cause(run.events)
        end = Outcome("failed", f"failed with exit {code} after step {last}"
                                + (f": {cause}" if cause else ""))
    append_event(run.run_dir, RUN_END, end.text, outcome=end.kind, exit_code=code, step=last)
    return end
