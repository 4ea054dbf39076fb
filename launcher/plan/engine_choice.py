"""Which engine a layout needs, in words: the plan's ``engine_notes``.

:func:`engine_notes` asks every registered engine (:mod:`launcher.engines`) what it would do
with the layout: the chosen engine's summary and what it cannot run, and for each other engine
whether it would run the layout too. :mod:`launcher.plan.validate` turns the chosen engine's
refusals into plan problems (``EngineSpec.problems``).
"""

from __future__ import annotations

from launcher.config import TrainwrightConfig
from launcher.engines import REGISTRY, spec


def engine_notes(cfg: TrainwrightConfig) -> list[str]:
    """Why the chosen engine runs this layout, and what the other engines would not run."""
    chosen = spec(cfg.engine.name)
    others = [spec(name) for name in REGISTRY if name != chosen.name]
    blocked = {other.name: other.cannot_run(cfg) for other in others}
    own = chosen.cannot_run(cfg)
    notes = [chosen.summary(cfg) + ("" if own else " (works)")]
    fix = next((f"; use engine={name}" for name, b in blocked.items() if not b), "")
    notes += [f"engine={chosen.name} cannot run {b}{fix}" for b in own]
    for name, reasons in blocked.items():
        notes += ([f"engine={name} would not work: {b}" for b in reasons]
                  or [f"engine={name} would also run this layout"])
    return notes
