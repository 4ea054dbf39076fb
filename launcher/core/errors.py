"""Errors that end a training process, each with the exit code it ends with (:mod:`.exits`)."""

from __future__ import annotations

from launcher.core.exits import BAD_DATA_EXIT, CONFIG_ERROR_EXIT, FAILURE_EXIT


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for (or pointed at) cannot be used or written; the message
    names it."""

    exit_code = FAILURE_EXIT


class IncompatibleCheckpoint(CheckpointError):
    """A checkpoint this run must not (or cannot) load as configured: a different architecture,
    engine or a layout the engine cannot convert. A config error: the process exits 2 and the
    message names every difference and the settings that would resume it."""

    exit_code = CONFIG_ERROR_EXIT


class NonFiniteLoss(RuntimeError):
    """A micro-batch produced a NaN/inf loss on some rank (raised under nan_policy=abort)."""


class TrainingAborted(RuntimeError):
    """Training cannot continue (non-finite values); ``exit_code`` says how the process exits."""

    def __init__(self, message: str, exit_code: int = BAD_DATA_EXIT):
        super().__init__(message)
        self.exit_code = exit_code
