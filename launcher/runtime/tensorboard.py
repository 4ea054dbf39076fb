"""TensorBoard event files of a run (``logger.tensorboard``): :class:`TensorBoardLog`.

torch's own ``SummaryWriter`` (``torch.utils.tensorboard``, the ``tensorboard`` package) writes
the keys wandb gets into ``<run_dir>/tensorboard/``. A restarted or requeued run appends a new
event file to the same directory; the writer is opened at the first step the new attempt logs,
with ``purge_step`` at that step, so TensorBoard drops what the earlier attempt logged from that
step on (the steps recomputed since the checkpoint) and shows each step once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional

SUBDIR = "tensorboard"
"""The event directory inside the run directory."""


class TensorBoardLog:
    """Scalars of each logged step into the run's TensorBoard directory (rank 0 only)."""

    def __init__(self, run_dir: Path):
        self.log_dir = Path(run_dir) / SUBDIR
        self._writer: Any = None
        self.last_step: Optional[int] = None

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """``values``' finite numbers at ``step`` (the first call opens the writer, purging
        what an earlier attempt logged from ``step`` on)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=int(step))
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self._writer.add_scalar(key, value, global_step=int(step))
        self.last_step = int(step)

    def close(self, summary: Optional[Mapping[str, float]] = None) -> None:
        """Write ``summary`` (e.g. the goodput) at the last step logged, then close."""
        if self._writer is None:
            return
        if summary and self.last_step is not None:
            self.log(self.last_step, summary)
        self._writer.close()
        self._writer = None
