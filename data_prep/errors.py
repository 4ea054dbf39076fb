"""The errors data_prep reports, each with its exit code; messages say what to fix."""

from __future__ import annotations

CONFIG_ERROR_EXIT = 2
"""Exit code of config errors (bad override, missing input, unusable tokenizer, foreign output)."""
BAD_DATA_EXIT = 3
"""Exit code when strict=true meets a bad record or skipped records exceed max_bad_fraction."""
FAILURE_EXIT = 1
"""Exit code of any other failure, a crashed worker included."""


class DataPrepError(Exception):
    """Base class; ``exit_code`` is what the command-line tool exits with."""

    exit_code = FAILURE_EXIT


class ConfigError(DataPrepError):
    """Inputs, output or tokenizer settings that cannot work."""

    exit_code = CONFIG_ERROR_EXIT


class BadDataError(DataPrepError):
    """A bad record under strict=true, or too many skipped records."""

    exit_code = BAD_DATA_EXIT


class WorkerError(DataPrepError):
    """A worker process raised or died; the run is incomplete."""

    exit_code = FAILURE_EXIT
