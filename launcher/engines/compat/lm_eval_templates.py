"""lm-evaluation-harness 0.4.13's task templates compiled once per text."""

from __future__ import annotations

import functools
from pathlib import Path

from launcher.engines.compat.shim import Shim, applied_by_caller


def compiled_templates_kept() -> None:
    """lm-evaluation-harness compiles a task's Jinja template again for every document it
    renders (``utils.apply_template``: ``env.from_string`` at each call, 0.6 ms here): 0.6 s of
    every rank's 2.6 s for 240 four-choice questions, and minutes for a task of tens of
    thousands of documents. Each template text is compiled once (the same ``env``, so the same
    filters and undefined rule); what renders is unchanged. Applied by the harness before a run
    of tasks."""
    from lm_eval import utils

    if getattr(utils.apply_template, "_trainwright_cached", False):
        return

    @functools.lru_cache(maxsize=4096)
    def compiled(template: str):
        return utils.env.from_string(template)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    apply_template._trainwright_cached = True
    utils.apply_template = apply_template


def _probe_template_compiles() -> bool:
    import inspect

    from lm_eval import utils

    source = Path(inspect.getfile(utils)).read_text()
    return ("def apply_template(template: str, doc: dict) -> str:\n"
            "    rtemplate = env.from_string(template)" in source)


SHIMS = (
    Shim("compiled task templates kept", "lm-eval", "0.4.13", applied_by_caller, None,
         _probe_template_compiles, "compiled_templates_kept, before a run of tasks: "
         "utils.apply_template compiles the task's Jinja template again for every document"),
)
