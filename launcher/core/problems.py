"""A plan problem and the helpers its messages use (every factor printed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One reason a config cannot be trained: the keys involved and a message with the fix."""

    keys: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return self.message


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n`` (the values a fix may choose from)."""
    return [k for k in range(1, n + 1) if n % k == 0] if n > 0 else []


def fmt_values(values: list[int], limit: int = 12) -> str:
    """``1, 2, 4, ...``: at most ``limit`` values for a message."""
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (", ..." if len(values) > limit else "")
