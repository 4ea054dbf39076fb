"""Checkpoints of ``engine=megatron`` engines built in-process (tests.helpers.engines.build):
``build`` remembers what an engine's checkpoint manager needs, ``_save``/``_load`` go through one
CheckpointManager per (engine, directory) as launcher.train keeps one per run, ``_batches`` and
``_steps`` train on fixed batches, ``_finish`` tears Megatron's parallel state down.

Formerly in tests/test_megatron_checkpoint.py (names kept); tests/test_uneven_pipeline.py uses
them too.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.engines import build as build_engine
from tests.helpers.engines import fixed_batches


def _batches(cfg, count: int) -> list:
    next_batch = fixed_batches(cfg.model.vocab_size, cfg.model.seq_length,
                               cfg.trainer.micro_batch_size, 3)
    return [next_batch() for _ in range(count)]


def _steps(eng, cfg, plan, batches: list, steps: int) -> list:
    """Train ``steps`` steps, each on the next grad_accum batches; (loss, grad norm) per step."""
    from launcher.core.phases import PhaseTimer

    out, it = [], iter(batches)
    for _ in range(steps):
        result = eng.train_step(lambda: next(it), 1e-3, PhaseTimer())
        out.append([result.loss, result.grad_norm])
    return out


_MANAGERS: dict = {}
"""One CheckpointManager per (engine, directory), as launcher.train keeps one per run."""
_SETTINGS: dict = {}
"""id(engine) -> (trainer.async_save, plan.batch.train_steps) it was built with."""


def build(overrides):
    """(cfg, plan, engine) as tests.helpers.engines.build builds them, remembering what the
    engine's checkpoint manager needs."""
    cfg, plan, eng = build_engine(overrides)
    _SETTINGS[id(eng)] = (cfg.trainer.async_save, plan.batch.train_steps)
    return cfg, plan, eng


def _manager(eng, directory: Path):
    """The run's checkpoint manager (async_save as the engine's trainer config says)."""
    from launcher.runtime.checkpoint import CheckpointManager

    key = (id(eng), str(directory))
    if key not in _MANAGERS or _MANAGERS[key].io is not eng.checkpoint_io:  # ids are reused
        async_save, final_step = _SETTINGS[id(eng)]
        _MANAGERS[key] = CheckpointManager(directory, eng.checkpoint_io, keep_last=2,
                                           async_save=async_save, final_step=final_step)
    return _MANAGERS[key]


def _save(eng, directory: Path, step: int, background: bool = True):
    return _manager(eng, directory).save(step, consumed_samples=step, config={}, plan={},
                                         background=background)


def _load(eng, directory: Path) -> None:
    from launcher.core.checkpoints import find_resume

    _manager(eng, directory).load(find_resume(directory.parent))


def _finish() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
