"""Hostile text for override and quoting tests: ``HOSTILE`` holds shell metacharacters, both
quotes, Slurm's filename patterns and backslashes; ``hydra_quote`` makes a Hydra override value
that holds a string verbatim.

Formerly in tests/test_submit_script.py; tests/test_slurm_jobs.py uses them too.
"""

from __future__ import annotations

HOSTILE = 'a b "dq" \'sq\' $(touch PWNED1) `touch PWNED2` %j %% \\ x\\y ; touch PWNED3 &&'


def hydra_quote(value: str) -> str:
    """A Hydra override value holding ``value`` verbatim (single-quoted, quotes escaped)."""
    return "'" + value.replace("'", "\\'") + "'"
