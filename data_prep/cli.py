"""``python -m data_prep [overrides]``: compose conf/prepare.yaml, run, print the summary.

``output=s3://bucket/folder`` writes into a staging directory, then publishes it to the store,
the manifest last (data_prep.remote_output).

Exit codes: 0 done; 2 config error (an output locked by a live run included; an object store
that cannot be written); 3 bad data (strict=true, too many skipped records, no documents, a
truncated or corrupt input file, an input changed during the run); 75 stopped by SIGUSR1 for
requeue (a batch job's early warning before its time limit); 1 any other failure, a crashed
worker, a full output disk and a store that kept failing mid-upload included. SIGTERM (Slurm's
scancel or time limit) ends the run like Ctrl-C: the pool is stopped and the output lock
released, so a resubmitted job can take the output. SIGUSR1 ends it the same way, with exit 75.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import List, Sequence

import data_prep.config  # noqa: F401  (registers prepare_schema)
from data_prep.errors import DataPrepError, StopForRequeue
from launcher.core.exits import CONFIG_ERROR_EXIT, FAILURE_EXIT, REQUEUE_EXIT

USAGE = """usage: python -m data_prep input=<file|glob|dir|[a,b]> output=<dir> [key=value ...]
  output=s3://bucket/folder: written into staging_dir=<dir>, then uploaded, the manifest last
  tokenizer.kind=hf|tiktoken|sentencepiece|byte tokenizer.path=<file|dir|encoding name>
  workers=N  shard_tokens=N  shard_bytes=N  text_key=text  strict=true  max_bad_fraction=0.001
  num_tasks=N task_index=I (default from SLURM_ARRAY_TASK_COUNT / SLURM_ARRAY_TASK_ID)
  format=auto|jsonl|parquet|text, or format=chat: conversations for fine-tuning, packed with a
    loss mask: seq_length=N (the model's) chat.template=<name|file.jinja> (default: the
    tokenizer's) chat.mask=assistant|last|all chat.pack=true chat.overlong=truncate|drop
    chat.pack_window=N chat.pack_multiple=M (2 x context_parallel_size under TE)
Every key is documented in data_prep/config.py and docs/data_prep.md."""


def normalize_overrides(argv: Sequence[str]) -> List[str]:
    """Let ``input=<one path>`` stand for ``input=[<one path>]``."""
    result = []
    for arg in argv:
        if arg.startswith("input=") and not arg[len("input="):].lstrip().startswith("["):
            arg = f"input=[{arg[len('input='):]}]"
        result.append(arg)
    return result


def compose(argv: Sequence[str], config_name: str = "prepare"):
    """The composed config; prints the error and exits with code 2 when it does not compose."""
    from launcher.compose import compose_config, ConfigError

    try:
        return compose_config(normalize_overrides(argv), config_name=config_name, schema="data_prep.config")
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT) from None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _ignore_stop_signals() -> None:
    """A run stops once: a repeated signal (Slurm sends SIGTERM to the whole job; a wrapper may
    forward what this process already got) must not cut the clean-up short (pool, output lock)."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def _interrupt(signum, frame) -> None:
    _ignore_stop_signals()
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_for_requeue(signum, frame) -> None:
    _ignore_stop_signals()
    raise StopForRequeue(f"signal {signum}")


def task_warnings(manifest: dict) -> List[str]:
    """An array task without documents succeeds (data_prep.merge judges the whole run); say so."""
    task = manifest["task"]
    totals = manifest["totals"]
    if task["count"] == 1 or totals.get("documents", totals.get("conversations")):
        return []
    unit = "conversations" if manifest.get("format") == "chat" else "documents"
    return [f"task {task['index']} of {task['count']} found no {unit} in its "
            f"{len(manifest['inputs'])} input file(s); data_prep.merge combines the other tasks"]


def dry_run(cfg) -> int:
    """``dry_run=true``: print the plan and the sample's estimates; nothing is written."""
    from data_prep.estimate import estimate, print_estimate

    print_estimate(estimate(cfg))
    return 0


def run_chat(cfg, folder=None) -> int:
    """format=chat (data_prep.chat_prep): conversations into packed, masked shards (published to
    ``folder`` on the store, when given)."""
    from data_prep.chat_prep import execute_chat, print_chat_summary
    from data_prep.run import check_bad_fraction

    manifest = execute_chat(cfg)
    print_chat_summary(manifest)
    for warning in task_warnings(manifest):
        print(f"data_prep: warning: {warning}", file=sys.stderr)
    check_bad_fraction(manifest, cfg.max_bad_fraction)
    print(f"wrote {manifest['totals']['shards']} shard(s) and the manifest to {cfg.output}")
    publish(cfg, folder)
    return 0


def publish(cfg, folder) -> None:
    """output=s3://...: upload the finished output, the manifest last (data_prep.remote_output);
    an output whose bad records exceeded max_bad_fraction (exit 3) is not published."""
    if folder is not None:
        from data_prep.remote_output import publish_output

        publish_output(cfg.output, folder, replace=cfg.overwrite)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    cfg = compose(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGUSR1, _stop_for_requeue)
    from data_prep.progress import print_summary, small_shard_warnings
    from data_prep.run import check_bad_fraction, execute

    try:
        from data_prep.remote_output import staged

        folder = staged(cfg)  # output=s3://...: written into a staging directory, then uploaded
        if cfg.dry_run and str(cfg.format) == "chat":
            from data_prep.chat_estimate import chat_dry_run

            return chat_dry_run(cfg)
        if cfg.dry_run:
            return dry_run(cfg)
        if str(cfg.format) == "chat":
            return run_chat(cfg, folder)
        manifest = execute(cfg)
        print_summary(manifest)
        for warning in small_shard_warnings(manifest, cfg.split) + task_warnings(manifest):
            print(f"data_prep: warning: {warning}", file=sys.stderr)
        check_bad_fraction(manifest, cfg.max_bad_fraction)
        print(f"wrote {manifest['totals']['shards']} shard(s) and the manifest to {cfg.output}")
        publish(cfg, folder)
    except DataPrepError as exc:
        print(f"data_prep: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except StopForRequeue:
        print("data_prep: stopped for requeue (SIGUSR1); the committed shards are kept and the "
              "requeued job resumes after them", file=sys.stderr)
        return REQUEUE_EXIT
    except KeyboardInterrupt:
        print("data_prep: interrupted; re-run the same command to resume", file=sys.stderr)
        return FAILURE_EXIT
    except Exception as exc:  # a worker's exception arrives here too
        print(f"data_prep: failed: {type(exc).__name__}: {exc}; re-run the same command to resume "
              "after fixing the cause", file=sys.stderr)
        return FAILURE_EXIT
    return 0
