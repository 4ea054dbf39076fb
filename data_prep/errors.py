"""The errors data_prep reports, each with its exit code; messages say what to fix."""

from __future__ import annotations

from typing import Mapping, Sequence

from launcher.core.exits import BAD_DATA_EXIT, CONFIG_ERROR_EXIT, FAILURE_EXIT

# data_prep's use of the exit codes every trainwright command shares (launcher.core.exits):
# CONFIG_ERROR_EXIT (2): bad override, missing input, unusable tokenizer, foreign output, an
#   output locked by a live run;
# BAD_DATA_EXIT (3): strict=true meets a bad record, skipped records exceed max_bad_fraction, the
#   inputs hold no document, a compressed input is truncated or corrupt, an input changed
#   during the run;
# REQUEUE_EXIT (75): stopped by SIGUSR1, the early warning a batch job gets before its time limit
#   (``#SBATCH --signal=B:USR1@300``): its committed shards are kept, and the array recipe
#   requeues the job, which resumes after them;
# FAILURE_EXIT (1): any other failure, a crashed worker included.


class StopForRequeue(KeyboardInterrupt):
    """Raised in the main process by SIGUSR1: stop like Ctrl-C, then exit with REQUEUE_EXIT."""


class DataPrepError(Exception):
    """Base class; ``exit_code`` is what the command-line tool exits with."""

    exit_code = FAILURE_EXIT


class ConfigError(DataPrepError):
    """Inputs, output or tokenizer settings that cannot work."""

    exit_code = CONFIG_ERROR_EXIT


class BadDataError(DataPrepError):
    """A bad record under strict=true, or too many skipped records."""

    exit_code = BAD_DATA_EXIT


class OutputLockedError(ConfigError):
    """Another live data_prep run writes the same output (the message names its host and pid)."""


class CorruptInputError(BadDataError):
    """A compressed input is truncated or damaged (the message names the file)."""


class InputChangedError(BadDataError):
    """An input file was changed, truncated or removed while the run read it (the message names
    every such file and what changed)."""


class WorkerError(DataPrepError):
    """A worker process raised or died; the run is incomplete."""

    exit_code = FAILURE_EXIT


def no_documents_error(paths: Sequence[str], skipped: Mapping[str, int]) -> BadDataError:
    """The error of a run whose inputs ``paths`` held no document (``skipped``: reason -> records)."""
    named = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(skipped.items()) if count)
    return BadDataError(f"no documents were found in the input(s) {named or '(no files)'}"
                        f" (skipped: {reasons or 'nothing'}); nothing was written. Check that "
                        "the inputs hold text and that text_key=/format=/text_unit= match them")
