"""Checks of the data a run will read against its config, before anything is launched.

data_prep writes ``manifest.json`` beside its shards, naming the tokenizer and its vocabulary
size. Token ids at or above ``model.vocab_size`` would index past the embedding table (a device
assert on a GPU, an IndexError on a CPU, after the job has queued and started), so a tokenizer
larger than the model is refused here, with the manifest's path and the fix. Prefixes without a
manifest (data prepared elsewhere) are not checked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence


def vocab_problems(prefixes: Sequence[str], vocab_size: int) -> list[str]:
    """One message per data_prep manifest whose tokenizer vocabulary exceeds ``vocab_size``."""
    problems = []
    for path in sorted({Path(p).parent / "manifest.json" for p in prefixes}):
        if not path.is_file():
            continue
        try:
            tokenizer = json.loads(path.read_text()).get("tokenizer") or {}
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: cannot be read as JSON ({exc}); re-run data_prep for it")
            continue
        data_vocab = tokenizer.get("vocab_size")
        if isinstance(data_vocab, int) and data_vocab > vocab_size:
            problems.append(
                f"model.vocab_size={vocab_size} is smaller than the vocabulary of the tokenizer "
                f"that wrote {path.parent} ({tokenizer.get('kind', '?')} "
                f"{tokenizer.get('path') or tokenizer.get('name') or ''}: vocab_size="
                f"{data_vocab}, see {path}); token ids up to {data_vocab - 1} would index past "
                f"the embedding: set model.vocab_size={data_vocab} (or more)")
    return problems


def check_data_or_exit(prefixes: Sequence[str], vocab_size: int) -> None:
    """Print every problem of :func:`vocab_problems` and exit 2 when there is any."""
    from launcher.core.exits import CONFIG_ERROR_EXIT

    problems = vocab_problems(prefixes, vocab_size)
    if problems:
        print(f"data: {len(problems)} problem(s):\n" + "\n".join(f"- {p}" for p in problems),
              file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
