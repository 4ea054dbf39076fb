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
:class:`launcher.runtime.checkpoint.CheckpointManager`'s; the directory layout is
:mod:`launcher.core.checkpoints`).

Torch-free: the plan imports it through the engine specs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol

from launcher.config import (EngineConfig, ModelConfig, OptimizerConfig, ParallelismConfig,
                             Precision, TrainerConfig, TrainwrightConfig)
from launcher.core.phases import PhaseTimer
from launcher.core.problems import Problem
from launcher.shape import Batch


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


class CheckpointIO(Protocol):
    """An engine's native checkpoint writer/reader for one step directory."""

    def write(self, step_dir: Path, *, background: bool) -> bool:
        """Write the engine state under ``step_dir`` (collective). With ``background`` the engine
        may only schedule the write; returns True when it did (see :meth:`finish_background`)."""

    def finish_background(self, blocking: bool) -> bool:
        """Complete scheduled writes every rank has finished (``blocking``: wait for all);
        True when none is left (collective while one is pending)."""

    def prepare_read(self) -> None:
        """Allocate what a read fills and needs no file for (e.g. the optimizer's state), while
        the checkpoint's files are still arriving (collective; may do nothing)."""

    def read(self, step_dir: Path) -> None:
        """Load the engine state from ``step_dir`` into this layout (collective)."""


class Engine(Protocol):
    """What :class:`launcher.runtime.loop.TrainLoop` drives."""

    checkpoint_io: CheckpointIO

    def train_step(self, next_batch: Callable[[], dict], lr: float,
                   timer: PhaseTimer) -> StepResult:
        """One optimizer step over the step's micro-batches, phases timed on ``timer``."""

    def eval_loss(self, batches: Iterable[dict]) -> float:
        """Mean masked loss over ``batches`` on all ranks."""

    def label_scores(self, batches: list[dict]) -> Optional[list[tuple]]:
        """Forward only, model in eval mode: per micro-batch of ``batches`` (tokens, labels,
        loss_mask, position_ids, row_ids, and segment_ids where rows share a sequence: this
        replica's, launcher/evals/rows.py), per scored row (summed log-probability of its masked
        labels, masked labels that are not the argmax), float64 tensors on the host; on the
        ranks whose sums count (the last pipeline stage's tensor-parallel rank 0, each
        context-parallel rank a part of the sequence), None on the others. Collective."""

    def next_tokens(self, tokens, ends: list[int]) -> list[int]:
        """Forward only, model in eval mode: the greedy next token of each row of ``tokens``
        ([b, s] on the host; row ``i``'s own tokens are its first ``ends[i]``), on every rank of
        this replica (generation tasks). Collective within the replica."""

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel replica, replicas): who scores which rows."""

    def reduce_phase_times(self, times: dict[str, float]) -> dict[str, float]:
        """Per-phase seconds as logged (e.g. the maximum over pipeline stages; collective)."""


@dataclass(frozen=True)
class Rule:
    """One setting an engine cannot run, written once: when it applies, what the plan's engine
    notes say of it (None: nothing) and the problem that refuses it, with its fix (None: the
    plan does not refuse it, e.g. another rule already does)."""

    keys: tuple[str, ...]
    applies: Callable[[TrainwrightConfig], bool]
    note: Callable[[TrainwrightConfig], Optional[str]]
    fix: Callable[[TrainwrightConfig], Optional[str]]


class RuleBook:
    """An engine spec's ``cannot_run`` and ``problems``, both read off its ``RULES``."""

    RULES: tuple[Rule, ...] = ()

    def cannot_run(self, cfg: TrainwrightConfig) -> list[str]:
        """The notes of the rules that apply to ``cfg``."""
        return [note for rule in self.RULES if rule.applies(cfg) and (note := rule.note(cfg))]

    def problems(self, cfg: TrainwrightConfig) -> list[Problem]:
        """A :class:`Problem` for each rule that applies to ``cfg`` and refuses it."""
        return [Problem(rule.keys, fix) for rule in self.RULES
                if rule.applies(cfg) and (fix := rule.fix(cfg))]


class EngineSpec(Protocol):
    """An engine as the plan and the launcher see it (torch-free; ``build`` imports torch)."""

    name: str

    def summary(self, cfg: TrainwrightConfig) -> str:
        """What the engine does with this layout, in one line."""

    def cannot_run(self, cfg: TrainwrightConfig) -> list[str]:
        """Settings of ``cfg`` this engine cannot run, each with its reason (for the notes)."""

    def problems(self, cfg: TrainwrightConfig) -> list[Problem]:
        """A :class:`Problem` for each setting of ``cfg`` this engine refuses."""

    def state_bytes(self, *, precision: Precision, zero_stage: int, grad_fp32: bool,
                    offload_optimizer: bool, offload_params: bool, shards: int) -> StateBytes:
        """Bytes per parameter on one GPU when ``shards`` replicas share the state."""

    def gathered_layers(self, zero_stage: int) -> int:
        """Whole layers of weights a GPU gathers at once on top of its shard (ZeRO-3)."""

    def build(self, *, batch: Batch, model: ModelConfig,
              parallelism: ParallelismConfig, optimizer: OptimizerConfig,
              trainer: TrainerConfig, engine: EngineConfig) -> Engine:
        """The runtime engine on an initialised parallel state (collective)."""

    def run_files(self, *, batch: Batch,
                  parallelism: ParallelismConfig, optimizer: OptimizerConfig,
                  trainer: TrainerConfig, engine: EngineConfig) -> dict[str, Any]:
        """Files (name -> JSON-able object) rank 0 writes into the run directory."""
