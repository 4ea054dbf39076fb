"""The engine contract, torch-free: what the plan asks of an engine and what the loop drives.

An engine is a package ``launcher/engines/<name>/`` whose ``__init__`` defines ``SPEC``, an
:class:`EngineSpec`. The spec answers the plan's questions without importing torch (which
layouts it cannot run, the problems a config has for it, bytes of training state per
parameter) and builds the runtime :class:`Engine` on an initialised parallel state. The
registry (:mod:`launcher.engines`) maps ``engine.name`` to the package; adding an engine means
adding its package and one registry line.

The runtime engine hands the training loop one :class:`StepResult` per optimizer step and a
:class:`CheckpointIO` that writes and reads its state natively inside a step directory (the
neutral protocol around it, ``step_N.tmp`` -> ``complete`` -> rename -> ``latest``, is
:class:`launcher.runtime.checkpoint.CheckpointManager`'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for (or pointed at) cannot be used; the message names it."""


class NonFiniteLoss(RuntimeError):
    """A micro-batch produced a NaN/inf loss on some rank (raised under nan_policy=abort)."""


@dataclass
class StepResult:
    """What one optimizer step reports (loss averaged over micro-batches and data-parallel ranks).

    ``extra`` holds engine-specific metrics that the loop logs as they are (e.g.
    ``moe/load_balancing_loss``)."""

    loss: float
    grad_norm: Optional[float]
    loss_scale: float
    skipped: bool
    micro_batches: int
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter kept on the GPU (and in CPU memory, when offloaded)."""

    weights: float
    grads: float
    optimizer: float
    cpu: float = 0.0


@dataclass(frozen=True)
class EngineProblem:
    """A config the engine cannot run: the keys involved and a message with the fix."""

    keys: tuple
    message: str


class CheckpointIO(Protocol):
    """An engine's native checkpoint writer/reader for one step directory."""

    def warm_up(self) -> None:
        """Start, off the critical path, what the first write would otherwise start itself
        (called once by the checkpoint manager of a run; may do nothing)."""

    def write(self, step_dir: Path, *, background: bool) -> bool:
        """Write the engine state under ``step_dir`` (collective). With ``background`` the engine
        may only schedule the write; returns True when it did (see :meth:`finish_background`)."""

    def finish_background(self, blocking: bool) -> bool:
        """Complete scheduled writes every rank has finished (``blocking``: wait for all);
        True when none is left (collective while one is pending)."""

    def read(self, step_dir: Path) -> None:
        """Load the engine state from ``step_dir`` into this layout (collective)."""


class Engine(Protocol):
    """What :class:`launcher.runtime.loop.TrainLoop` drives."""

    checkpoint_io: CheckpointIO

    def train_step(self, next_batch: Callable[[], dict], lr: float, timer: Any) -> StepResult:
        """One optimizer step over the step's micro-batches, phases timed on ``timer``."""

    def eval_loss(self, batches: Any) -> float:
        """Mean masked loss over ``batches`` on all ranks."""

    def reduce_phase_times(self, times: dict) -> dict:
        """Per-phase seconds as logged (e.g. the maximum over pipeline stages; collective)."""


class EngineSpec(Protocol):
    """An engine as the plan and the launcher see it (torch-free; ``build`` imports torch)."""

    name: str

    def summary(self, cfg: Any) -> str:
        """What the engine does with this layout, in one line."""

    def cannot_run(self, cfg: Any) -> list:
        """Settings of ``cfg`` this engine cannot run, each with its reason (for the notes)."""

    def problems(self, cfg: Any) -> list:
        """:class:`EngineProblem` for each setting of ``cfg`` this engine refuses."""

    def state_bytes(self, *, precision: Any, zero_stage: int, grad_fp32: bool,
                    offload_optimizer: bool, offload_params: bool, shards: int) -> StateBytes:
        """Bytes per parameter on one GPU when ``shards`` replicas share the state."""

    def gathered_layers(self, zero_stage: int) -> int:
        """Whole layers of weights a GPU gathers at once on top of its shard (ZeRO-3)."""

    def build(self, plan: Any, *, model: Any, parallelism: Any, optimizer: Any, trainer: Any,
              engine: Any) -> Engine:
        """The runtime engine on an initialised parallel state (collective)."""

    def run_files(self, plan: Any, *, parallelism: Any, optimizer: Any, trainer: Any,
                  engine: Any) -> dict:
        """Files (name -> JSON-able object) rank 0 writes into the run directory."""


def mixed_precision_bytes(precision: Any, grad_fp32: bool) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter before any sharding: 2-byte weights,
    2- or 4-byte gradients and 12 bytes of fp32 master copy + Adam moments under bf16/fp16
    (the ZeRO paper's accounting); 4, 4 and 8 under fp32."""
    mixed = getattr(precision, "value", precision) != "fp32"
    weight = 2 if mixed else 4
    grad = 4 if (grad_fp32 or not mixed) else 2
    return weight, grad, 12 if mixed else 8
