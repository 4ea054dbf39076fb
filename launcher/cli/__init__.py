"""Hydra's command-line flags on the entry points that compose outside ``@hydra.main``.

``python -m launcher.train|plan|submit`` take Hydra's flags (``--help``, ``--cfg``, ``--info``,
``--shell-completion``, ``--hydra-help``, ``--version``, ...) as a ``@hydra.main`` app does, and
keep their own error contract: every config error is one message and exit code 2. A command line
without flags goes through untouched (:func:`handle_flags`).
"""

from launcher.cli.flags import ENTRY_POINTS, handle_flags

__all__ = ["ENTRY_POINTS", "handle_flags"]
