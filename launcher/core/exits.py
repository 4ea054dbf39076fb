"""Exit codes: the contract between a trainwright process and whatever started it.

Schedulers act on them: Slurm's wrapper requeues the job on :data:`REQUEUE_EXIT` only; a
config, plan or data error (:data:`CONFIG_ERROR_EXIT`, :data:`BAD_DATA_EXIT`) would fail again
the same way and is never retried; any other failure (:data:`FAILURE_EXIT`, a death by signal N
as 128 + N) may be.
"""

from __future__ import annotations

FAILURE_EXIT = 1
"""Any other failure (a crash, a rank that died, a checkpoint that cannot be written)."""

CONFIG_ERROR_EXIT = 2
"""A config or plan error, an unusable input named by the user (bad override, missing file,
incompatible checkpoint, locked run directory): the message names the key and the fix."""

BAD_DATA_EXIT = 3
"""The numbers or the data went bad: a non-finite loss or gradient in training
(trainer.nan_policy), bad records or a changed input in data_prep. Retrying reproduces it."""

REQUEUE_EXIT = 75
"""Stopped on request with everything kept ("requeue me"; EX_TEMPFAIL of sysexits.h): training
saved a checkpoint after a stop signal, data_prep kept its committed shards."""

STORAGE_EXIT = 4
"""Checkpoints could not be saved ``trainer.checkpoint_failures_allowed`` times in a row (the
object store kept failing): a restart would train on without a way to keep its work, so
nothing restarts it until the store is mended; resume then continues from the last commit."""

PERMANENT_EXITS = (CONFIG_ERROR_EXIT, BAD_DATA_EXIT, STORAGE_EXIT)
"""Codes a scheduler must not retry."""
