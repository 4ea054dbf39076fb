"""Rank-0 side effects of training metrics: metrics.jsonl, events.jsonl, console, wandb.

Every rank calls :func:`make_metrics_logger`; rank 0 gets a :class:`MetricsLogger`, the others a
:class:`NullMetricsLogger` with the same methods doing nothing, so the training loop never
branches on the rank:

    metrics = make_metrics_logger(rank, run_dir=run_dir, logger=cfg.logger, run_name=name,
                                  config=to_plain(cfg))
    metrics.log(step, {"loss": 2.31, "lr": 3e-4, **timer_metrics(timer.snapshot())})
    metrics.log_event("loss_spike", "loss 9.1 > 3.0 x recent max 2.9", step=step, loss=9.1)
    metrics.close()

Keys are documented in docs/metrics.md. Nothing secret is written: the wandb config is passed
through :func:`launcher.runtime.rundir.redact`, event text through
:func:`launcher.runtime.rundir.redact_text`.

TensorBoard: with ``logger.tensorboard`` the same keys also go to ``<run_dir>/tensorboard/``
(:mod:`launcher.runtime.tensorboard`).

wandb: with ``logger.name == "wandb"`` a run is started in ``<run_dir>/wandb``. Its id is kept in
``<run_dir>/wandb_id`` (written on the first start), and later starts of the same run directory
resume it (``resume="allow"``), so a requeued job continues the same wandb run. ``WANDB_MODE``
(online, offline, disabled) overrides ``logger.mode``.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from launcher.config import LoggerConfig
from launcher.core.atomic import atomic_write_json, atomic_write_text
from launcher.core.phases import PHASES
from launcher.runtime.rundir import (prepare_run_dir, redact, redact_text, secret_env_values,
                                     to_plain)
from launcher.runtime.tensorboard import TensorBoardLog

WANDB_ID_FILE = "wandb_id"
"""File in the run directory holding the wandb run id across restarts."""


def timer_metrics(snapshot: Mapping[str, float]) -> Dict[str, float]:
    """A PhaseTimer snapshot as metric keys: ``{"time/<phase>": seconds}``."""
    return {f"time/{name}": float(seconds) for name, seconds in snapshot.items()}


def _scalar(value: Any) -> Any:
    """Tensors, numpy scalars -> Python numbers; non-finite floats -> None (valid JSON)."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _with_all_phases(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """In a step record (one with any ``time/`` key), add ``time/<phase>`` = 0.0 for phases
    neither present nor part of a fused key. Other records (eval lines) are left alone, so a
    second wandb.log at the same step cannot overwrite the step's phase times with zeros."""
    covered = {part for key in metrics if key.startswith("time/")
               for part in key[len("time/"):].split("+")}
    if not covered:
        return metrics
    for phase in PHASES:
        if phase not in covered:
            metrics[f"time/{phase}"] = 0.0
    return metrics


def _fmt(value: Any, spec: str) -> str:
    return "nan" if value is None else format(value, spec)


def progress_line(step: int, m: Mapping[str, Any]) -> str:
    """The compact console line: step, loss, lr, grad_norm, tokens/s, eval loss and phase times."""
    parts = [f"step {step}"]
    for key, label, spec in (("loss", "loss", ".4f"), ("lr", "lr", ".3e"),
                             ("grad_norm", "gnorm", ".3f"), ("tokens_per_s", "tok/s", ",.0f"),
                             ("eval/loss", "eval loss", ".4f"), ("eval/perplexity", "ppl", ",.1f")):
        if key in m:
            parts.append(f"{label} {_fmt(m[key], spec)}")
    phases = " ".join(f"{k[5:]} {_fmt(v, '.3f')}" for k, v in m.items()
                      if k.startswith("time/") and v)
    if phases:
        parts.append(f"s: {phases}")
    parts += task_parts(m)
    return " | ".join(parts)


def task_parts(m: Mapping[str, Any]) -> list[str]:
    """'<task> <metric> <value> ...' per downstream task of ``eval/<task>/<metric>`` keys."""
    tasks: dict = {}
    for key, value in m.items():
        bits = key.split("/")
        if len(bits) == 3 and bits[0] == "eval" and not bits[2].startswith("examples"):
            tasks.setdefault(bits[1], []).append(f"{bits[2]} {_fmt(value, '.4g')}")
    return [f"{task} {' '.join(values)}" for task, values in tasks.items()]


def event_record(kind: str, message: str, secrets: list, **fields: Any) -> dict:
    """One line of events.jsonl: time, kind, message and fields, secrets redacted."""
    record = {"time": round(time.time(), 3), "kind": kind,
              "message": redact_text(str(message), secrets)}
    record.update(redact({k: _scalar(v) for k, v in to_plain(fields).items()}, secrets))
    return record


def append_event(run_dir: Path, kind: str, message: str, **fields: Any) -> None:
    """Add an event to ``run_dir/events.jsonl`` from outside the ranks (the launcher): one
    ``O_APPEND`` write, so it never interleaves with rank 0's lines."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    line = json.dumps(event_record(kind, message, secret_env_values(), **fields), default=str)
    fd = os.open(Path(run_dir) / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class NullMetricsLogger:
    """What ranks other than 0 get: every method does nothing."""

    run_dir: Optional[Path] = None
    wandb_run: Any = None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Do nothing."""

    def log_event(self, kind: str, message: str, echo: bool = True, **fields: Any) -> None:
        """Do nothing."""

    def log_late(self, step: int, metrics: Mapping[str, Any], x_key: str) -> None:
        """Do nothing."""

    def write_json(self, name: str, content: Any) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MetricsLogger(NullMetricsLogger):
    """Rank 0's logger: metrics.jsonl and events.jsonl in ``run_dir``, console, optional wandb."""

    def __init__(self, run_dir: Path, logger: LoggerConfig, run_name: str,
                 config: Mapping[str, Any], group: str = "", console: Any = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._secrets = secret_env_values()
        self._console = console or sys.stdout
        # unbuffered: each line is one write, so a write that fails (a full disk) leaves
        # nothing behind for a later flush or close to fail on again
        self._metrics = open(self.run_dir / "metrics.jsonl", "ab", buffering=0)
        self._events = open(self.run_dir / "events.jsonl", "ab", buffering=0)
        self.wandb_run = None
        self.tensorboard = TensorBoardLog(self.run_dir) if logger.tensorboard else None
        if logger.name not in ("none", "wandb"):
            self.close()
            raise ValueError(f"logger.name={logger.name!r} is not supported; use none or wandb")
        if logger.name == "wandb":
            try:
                self.wandb_run = _start_wandb(self.run_dir, logger, run_name,
                                              redact(to_plain(config), self._secrets), group)
            except BaseException:
                self.close()
                raise

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one JSON line (``step`` and the wall-clock ``time`` first; in step records
        every ``time/<phase>`` present), print the progress line, and log to wandb at
        ``step``."""
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update(_with_all_phases({str(k): _scalar(v) for k, v in metrics.items()
                                        if k not in ("step", "time")}))
        self._metrics.write((json.dumps(record) + "\n").encode())
        print(progress_line(int(step), record), file=self._console, flush=True)
        logged = {k: v for k, v in record.items() if k not in ("step", "time") and v is not None}
        if self.wandb_run is not None:
            self.wandb_run.log(logged, step=int(step))
        if self.tensorboard is not None:
            self.tensorboard.log(int(step), logged)

    def log_late(self, step: int, metrics: Mapping[str, Any], x_key: str) -> None:
        """A line about an earlier ``step`` (a checkpoint's scores from its own eval job):
        metrics.jsonl and TensorBoard at ``step``; wandb, which drops a step below its last, at
        its current one, each key charted against ``x_key`` (e.g. eval/tokens)."""
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update({str(k): _scalar(v) for k, v in metrics.items()})
        self._metrics.write((json.dumps(record) + "\n").encode())
        print(f"[eval] checkpoint step {step}: " + " | ".join(task_parts(record)),
              file=self._console, flush=True)
        logged = {k: v for k, v in record.items() if k not in ("step", "time") and v is not None}
        if self.wandb_run is not None:
            self.wandb_run.define_metric(x_key)
            for key in logged:
                if key != x_key:
                    self.wandb_run.define_metric(key, step_metric=x_key)
            self.wandb_run.log(logged)
        if self.tensorboard is not None:
            self.tensorboard.log(int(step), logged)

    def log_event(self, kind: str, message: str, echo: bool = True, **fields: Any) -> None:
        """A warning-level event (``loss_spike``, ``straggler``, ``nan_skip``, ``stop``, ...):
        one line in events.jsonl and (``echo``) on the console, secrets redacted."""
        record = event_record(kind, message, self._secrets, **fields)
        self._events.write((json.dumps(record, default=str) + "\n").encode())
        if not echo:
            return
        extra = " ".join(f"{k}={v}" for k, v in record.items()
                         if k not in ("time", "kind", "message"))
        print(f"[{kind}] {record['message']}" + (f" ({extra})" if extra else ""),
              file=self._console, flush=True)

    def write_json(self, name: str, content: Any) -> None:
        """``run_dir/<name>``: a file of the run (e.g. the engine's generated config), redacted
        and written atomically."""
        atomic_write_json(self.run_dir / name, redact(to_plain(content), self._secrets))

    def close(self) -> None:
        """Put the goodput account so far in the wandb run's summary (and TensorBoard's last
        step), finish the wandb run and close the files (safe to call twice)."""
        if self.wandb_run is not None or self.tensorboard is not None:
            summary = self._goodput_summary()
            if self.wandb_run is not None:
                self.wandb_run.summary.update(summary)
                self.wandb_run.finish()
                self.wandb_run = None
            if self.tensorboard is not None:
                self.tensorboard.close(summary)
                self.tensorboard = None
        for handle in (self._metrics, self._events):
            if not handle.closed:
                handle.close()

    def _goodput_summary(self) -> Dict[str, float]:
        from launcher.runtime.goodput import account

        acc = account(self.run_dir)
        return {"goodput": acc["goodput"], "goodput/wall_s": acc["wall_s"],
                **{f"goodput/lost_s/{k}": v for k, v in acc["lost_s"].items()}}


def _wandb_id(run_dir: Path) -> str:
    """The run directory's wandb id: read from ``wandb_id``, or created and stored once."""
    path = run_dir / WANDB_ID_FILE
    if path.exists():
        run_id = path.read_text(encoding="utf-8").strip()
        if run_id:
            return run_id
    alphabet = string.ascii_lowercase + string.digits
    run_id = "".join(secrets.choice(alphabet) for _ in range(12))
    atomic_write_text(path, run_id + "\n")
    return run_id


def _start_wandb(run_dir: Path, logger: LoggerConfig, run_name: str, config: Dict[str, Any],
                 group: str):
    """wandb.init in ``run_dir/wandb`` resuming the stored id; console capture and git off."""
    import wandb

    (run_dir / "wandb").mkdir(exist_ok=True)
    # x_disable_meta: wandb would store this process's command line (overrides may hold secrets)
    settings = wandb.Settings(console="off", quiet=True, disable_git=True, save_code=False,
                              x_disable_meta=True)
    return wandb.init(
        project=logger.project, entity=logger.entity or None,
        group=redact_text(group or logger.group) or None,
        tags=[redact_text(tag) for tag in logger.tags] or None, name=redact_text(run_name),
        id=_wandb_id(run_dir), resume="allow", dir=str(run_dir), config=config,
        mode=os.environ.get("WANDB_MODE") or logger.mode, settings=settings)


def make_metrics_logger(rank: int, *, run_dir: Path, logger: LoggerConfig, run_name: str,
                        config: Mapping[str, Any], plan: Any = None, group: str = "",
                        console: Any = None) -> Union[MetricsLogger, NullMetricsLogger]:
    """A :class:`MetricsLogger` on rank 0, a :class:`NullMetricsLogger` on every other rank.

    ``config`` is the resolved config (dict, DictConfig or dataclass); it goes to wandb redacted.
    With ``plan``, rank 0 first prepares the run directory
    (:func:`launcher.runtime.rundir.prepare_run_dir`: env.json, and config.yaml, plan.json and
    data.json on a first start; a restart records its config under configs/ and leaves those to
    :func:`launcher.runtime.resume.started`). ``group`` (e.g. the sweep name) overrides
    ``logger.group``; ``console`` is where step lines and events are printed (default stdout).
    """
    if rank != 0:
        return NullMetricsLogger()
    if plan is not None:
        prepare_run_dir(Path(run_dir), config=config, plan=plan)
    return MetricsLogger(Path(run_dir), logger, run_name, config, group=group, console=console)


Metrics = Union[MetricsLogger, NullMetricsLogger]
"""The run's metrics logger on rank 0, its no-op stand-in on every other rank."""
