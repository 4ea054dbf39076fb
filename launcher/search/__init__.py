"""Layout search: every parallel layout of a model on a cluster, checked by the plan, fitted to
GPU memory and ranked by the plan's step-time model (``python -m launcher.search``,
:mod:`launcher.search.__main__`). Pure and torch-free, like the plan; ``search.measure=K``
runs the best K through launcher.train."""

from launcher.search.search import SearchResult, search

__all__ = ["SearchResult", "search"]
