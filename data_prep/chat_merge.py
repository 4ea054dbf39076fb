"""The merge of ``format=chat`` array tasks (``python -m data_prep.merge <output>``).

Every task must have rendered with the same tokenizer, template and settings (mask policy,
packing, overlong policy, seq_length): the shards of one training set cannot mix them. The merged
manifest lists every task's shards in task order (the input order), its totals are the tasks'
sums, and the packing efficiency is recomputed over all rows. It is written with the data config,
``format: chat``, that training reads.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import List

from data_prep.errors import BadDataError

SAME_CHAT = ("template", "template_text", "mask", "pack", "overlong", "seq_length", "row_tokens",
             "pack_multiple")
"""chat settings every task must share."""
SAME_TOKENIZER = ("path", "vocab_size")
SUMMED = ("records", "conversations", "rows", "tokens", "target_tokens", "truncated",
          "dropped_long", "no_target", "bad_records")


def check_same_settings(manifests: List[dict]) -> None:
    """BadDataError naming the first setting a task differs in from task 0."""
    first = manifests[0]
    for m in manifests[1:]:
        index = m["task"]["index"]
        for key in ("dtype", "eod_id", "name"):
            if m[key] != first[key]:
                raise BadDataError(f"task {index} has {key}={m[key]!r} but task 0 has "
                                   f"{first[key]!r}; all tasks must run with the same settings")
        for group, keys in (("tokenizer", SAME_TOKENIZER), ("chat", SAME_CHAT)):
            for key in keys:
                if m[group].get(key) != first[group].get(key):
                    raise BadDataError(
                        f"task {index} has {group}.{key}={m[group].get(key)!r:.80} but task 0 "
                        f"has {first[group].get(key)!r:.80}; re-run the array with the same "
                        "tokenizer and chat settings")


def merged_totals(manifests: List[dict], examples_limit: int = 5) -> dict:
    """The tasks' totals summed; examples kept per reason up to ``examples_limit``."""
    totals = {key: sum(m["totals"][key] for m in manifests) for key in SUMMED}
    skipped, examples = Counter(), {}
    for m in manifests:
        skipped.update(m["totals"].get("skipped") or {})
        for reason, found in (m["totals"].get("examples") or {}).items():
            kept = examples.setdefault(reason, [])
            kept += found[:max(0, examples_limit - len(kept))]
    totals.update(skipped=dict(skipped), examples=examples,
                  shards=sum(len(m["shards"]) for m in manifests))
    return totals


def merge_chat_manifests(manifests: List[dict]) -> dict:
    """The one manifest of a chat array's task manifests (each complete, in task order)."""
    import data_prep

    if any(m.get("format") != "chat" for m in manifests):
        raise BadDataError("the task manifests mix format=chat and text tasks; re-run the array "
                           "with one format into an empty output")
    check_same_settings(manifests)
    first, totals = manifests[0], merged_totals(manifests)
    chat = dict(first["chat"])
    capacity = totals["rows"] * chat["row_tokens"]
    chat["packing_efficiency"] = round(totals["tokens"] / capacity, 6) if capacity else 0.0
    return {"tool": "data_prep", "version": data_prep.__version__, "format": "chat",
            "complete": True, "name": first["name"], "task": {"index": 0, "count": 1},
            "merged_tasks": len(manifests),
            "wall_time_s": round(sum(m["wall_time_s"] for m in manifests), 3),
            "dtype": first["dtype"], "eod_id": first["eod_id"], "tokenizer": first["tokenizer"],
            "chat": chat, "inputs": [f for m in manifests for f in m["inputs"]],
            "totals": totals,
            "shards": [dict(entry, task=m["task"]["index"]) for m in manifests
                       for entry in m["shards"]],
            "merged_at": time.time()}
