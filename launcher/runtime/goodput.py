"""Where a run's wall time went, across every attempt: the goodput account.

Read from the run directory only: ``events.jsonl`` (``attempt_start`` / ``attempt_end`` from
the launcher's watch, ``resume``, ``hang``) and ``metrics.jsonl`` (each step line's wall-clock
``time``, ``step_time`` and ``time/<phase>``). The wall time is the time the job held its
machines: every attempt from its start to its end, plus the gaps between an attempt and its
in-job restart (not the time a requeued job waited in the queue). It is split into:

* ``productive_s``: the step time of steps that were kept, less their data waits, saves and
  evaluations;
* ``lost_s``: ``startup`` (first attempt: import, build, load, to the first step),
  ``restart`` (later attempts: teardown, respawn, load, to the first step), ``checkpoint``
  (saves inside steps), ``eval``, ``data_wait``, ``recomputed`` (steps after the checkpoint a
  later attempt resumed from: thrown away), ``hang`` (an attempt's end after its last step
  when it ended hung: the time until detection), ``failure`` (the same after a crash),
  ``shutdown`` (after the last step of an attempt that ended normally: final save and exit),
  ``other`` (whatever is left: logging, gaps between steps).

The parts add up to the wall time by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from launcher.core.jsonl import read_jsonl

CAUSES = ("startup", "restart", "checkpoint", "eval", "data_wait", "recomputed", "hang",
          "failure", "shutdown", "other")


@dataclass
class AttemptSpan:
    number: int
    start: float
    end: Optional[float] = None
    cause: str = ""
    resumed_at: int = 0
    lines: list = field(default_factory=list)


def _spans(events: list, lines: list) -> list:
    """The attempts, each with its step lines, in time order."""
    spans: list[AttemptSpan] = []
    for e in events:
        if e["kind"] == "attempt_start":
            spans.append(AttemptSpan(int(e.get("attempt", 0)), e["time"]))
        elif e["kind"] == "attempt_end" and spans and spans[-1].end is None:
            spans[-1].end, spans[-1].cause = e["time"], e["message"].split(": ", 1)[-1]
        elif e["kind"] == "resume" and spans:
            spans[-1].resumed_at = int(e.get("step", _step_of(e["message"])))
    if not spans:  # one process, no launcher watch: the run's first record starts it
        first = min([e["time"] for e in events] + [ln["time"] - ln["step_time"] for ln in lines],
                    default=0.0)
        spans.append(AttemptSpan(0, first))
    for ln in lines:
        owner = [s for s in spans if s.start <= ln["time"]]
        (owner[-1] if owner else spans[0]).lines.append(ln)
    last = max([e["time"] for e in events] + [ln["time"] for ln in lines], default=0.0)
    for span in spans:
        span.end = span.end if span.end is not None else max(last, span.start)
    return spans


def _step_of(message: str) -> int:
    """'resumed from ... at step 10' -> 10."""
    tail = message.rsplit("at step", 1)[-1].strip().split()[0] if "at step" in message else "0"
    return int(tail) if tail.isdigit() else 0


def account(run_dir: Path) -> dict:
    """The goodput account of ``run_dir`` (module docstring): wall_s, productive_s, goodput,
    lost_s (cause -> seconds) and attempts."""
    run_dir = Path(run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    lines = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step_time" in r and "time" in r]
    spans = _spans(events, lines)
    lost = {cause: 0.0 for cause in CAUSES}
    productive, wall = 0.0, 0.0
    for i, span in enumerate(spans):
        nxt = spans[i + 1] if i + 1 < len(spans) else None
        redo_after = nxt.resumed_at if nxt is not None and nxt.number > 0 else None
        wall += span.end - span.start
        if nxt is not None and nxt.number > 0:
            wall += nxt.start - span.end
            lost["restart"] += nxt.start - span.end
        productive += _span_parts(span, redo_after, lost)
    lost["other"] += wall - productive - sum(lost.values())
    return {"wall_s": wall, "productive_s": productive,
            "goodput": productive / wall if wall > 0 else 0.0, "lost_s": lost,
            "attempts": [{"attempt": s.number, "start": s.start, "end": s.end,
                          "seconds": s.end - s.start, "cause": s.cause or "running",
                          "resumed_at": s.resumed_at,
                          "last_step": max((ln["step"] for ln in s.lines), default=None)}
                         for s in spans]}


def _span_parts(span: AttemptSpan, redo_after: Optional[int], lost: dict) -> float:
    """Add one attempt's losses to ``lost``; its productive seconds."""
    productive, previous = 0.0, span.resumed_at
    first_start = None
    for ln in sorted(span.lines, key=lambda r: r["time"]):
        n = max(1, ln["step"] - previous)
        previous = ln["step"]
        window = ln["step_time"] * n
        first_start = first_start if first_start is not None else ln["time"] - window
        waits = {"data_wait": ln.get("time/data", 0.0), "checkpoint": ln.get("time/checkpoint", 0.0),
                 "eval": ln.get("time/eval", 0.0)}
        for cause, per_step in waits.items():
            lost[cause] += per_step * n
        compute = window - sum(waits.values()) * n
        if redo_after is not None and ln["step"] > redo_after:
            lost["recomputed"] += compute
        else:
            productive += compute
    if first_start is None:  # no step: the whole attempt went to starting (or failing)
        lost["restart" if span.number > 0 else "startup"] += span.end - span.start
        return productive
    lost["restart" if span.number > 0 else "startup"] += max(0.0, first_start - span.start)
    tail = max(0.0, span.end - max(ln["time"] for ln in span.lines))
    kind = "hang" if "hung" in span.cause else \
        "shutdown" if span.cause in ("", "finished", "running") or "code 75" in span.cause \
        else "failure"
    lost[kind] += tail
    return productive


def summary_line(acc: dict) -> str:
    """``goodput 91.2% of 1h02m: startup 20 s, checkpoint 31 s, ...`` (causes above 0.5 s)."""
    parts = [f"{cause.replace('_', ' ')} {seconds:,.1f} s"
             for cause, seconds in sorted(acc["lost_s"].items(), key=lambda kv: -kv[1])
             if seconds >= 0.5]
    attempts = len(acc["attempts"])
    return (f"goodput {acc['goodput']:.1%} of {acc['wall_s']:,.1f} s wall"
            + (f" over {attempts} attempts" if attempts > 1 else "")
            + (f"; lost: {', '.join(parts)}" if parts else ""))


def print_summary(run_dir: Path) -> None:
    """The goodput line every run ends with (on stderr; by the launching process, or rank 0
    when each rank was started from outside)."""
    import sys

    from launcher.parallel.distributed import launch_rank

    if launch_rank() == 0 and (Path(run_dir) / "metrics.jsonl").exists():
        print(f"[goodput] {summary_line(account(run_dir))} (python -m launcher.report "
              f"{run_dir})", file=sys.stderr, flush=True)
