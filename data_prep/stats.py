"""Counters of documents, tokens, records and skip reasons, with their first few examples."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List

from data_prep.records import BAD_REASONS, NEUTRAL_REASONS, REPAIRS


@dataclass
class Stats:
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    text_chars: int = 0
    counts: Counter = field(default_factory=Counter)
    """Skip and repair reason -> records."""
    examples: Dict[str, List[str]] = field(default_factory=dict)
    """Reason -> 'file:line: detail' strings, the first ones in input order."""

    @property
    def bad(self) -> int:
        return sum(self.counts[r] for r in BAD_REASONS)

    @property
    def records(self) -> int:
        """Accepted documents plus bad records (blank lines are not records)."""
        return self.documents + self.bad

    def add_examples(self, reason: str, examples: List[str], limit: int) -> None:
        kept = self.examples.setdefault(reason, [])
        kept.extend(examples[: max(0, limit - len(kept))])

    def merge(self, other: "Stats", limit: int) -> None:
        self.documents += other.documents
        self.tokens += other.tokens
        self.input_bytes += other.input_bytes
        self.text_chars += other.text_chars
        self.counts.update(other.counts)
        for reason, examples in other.examples.items():
            self.add_examples(reason, examples, limit)

    def to_dict(self) -> dict:
        return {"documents": self.documents, "tokens": self.tokens, "input_bytes": self.input_bytes,
                "text_chars": self.text_chars,
                "skipped": {r: self.counts[r] for r in BAD_REASONS + NEUTRAL_REASONS if self.counts[r]},
                "repaired": {r: self.counts[r] for r in REPAIRS if self.counts[r]},
                "examples": {r: list(e) for r, e in self.examples.items() if e}}

    @classmethod
    def from_dict(cls, data: dict) -> "Stats":
        counts = Counter(data.get("skipped", {}))
        counts.update(data.get("repaired", {}))
        return cls(data.get("documents", 0), data.get("tokens", 0), data.get("input_bytes", 0),
                   data.get("text_chars", 0), counts, {r: list(e) for r, e in data.get("examples", {}).items()})
