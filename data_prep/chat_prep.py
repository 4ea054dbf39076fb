"""``python -m data_prep format=chat ...``: conversations into packed, masked shards.

Records (JSONL or Parquet: ``messages``, or ``prompt``/``completion``) are rendered with the chat
template and tokenized in a worker pool (:mod:`launcher.core.chat_render`: ids and a loss mask),
fitted to a row of ``seq_length + 1`` tokens (``chat.overlong``), packed best-fit decreasing a
window of ``chat.pack_window`` conversations at a time (:mod:`data_prep.packing`) and written as
two Megatron indexed datasets per shard (docs/fine_tuning.md):

    <name>_00000.bin/.idx         token ids; a sequence per conversation, a document per row
    <name>_00000.mask.bin/.idx    the loss mask (uint8, 1 = trained), the same sequences and rows

Array tasks (``num_tasks``/``task_index``, or a Slurm array) each take a contiguous share of the
inputs, as in pretraining data_prep: shards ``<name>_task<IIIII>_<NNNNN>``, the manifest
``manifest.task-<IIIII>-of-<NNNNN>.json``, and ``python -m data_prep.merge`` writes the one
manifest and data config (:mod:`data_prep.chat_merge`).

Bad records (not JSON, no assistant turn, an unknown role, ...) are counted by reason with
file:line examples, as in pretraining data_prep (``strict``, ``max_bad_fraction``). Files reach
their final names only complete (written under ``.tmp``, fsynced, renamed); the manifest comes last.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from data_prep.chat_records import rendered
from data_prep.chat_shards import ChatShards, intact_prefix, remove_other_files
from data_prep.errors import BadDataError, ConfigError
from data_prep.packing import best_fit_decreasing



@dataclass
class Sample:
    ids: np.ndarray
    mask: np.ndarray


@dataclass
class ChatTally:
    """What became of the records."""

    records: int = 0
    samples: int = 0
    tokens: int = 0
    target_tokens: int = 0
    truncated: int = 0
    dropped_long: int = 0
    no_target: int = 0
    """Conversations left without a trained token (after truncation, or a mask policy that
    trains none of them): not written."""
    rows: int = 0
    counts: Counter = field(default_factory=Counter)
    """Skip reason -> records."""
    examples: dict = field(default_factory=dict)
    """Skip reason -> up to examples_per_reason [path, line, detail]."""

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in COUNTS}, "counts": dict(self.counts),
                "examples": self.examples}

    @classmethod
    def from_dict(cls, saved: dict) -> "ChatTally":
        tally = cls(**{k: int(saved.get(k, 0)) for k in COUNTS})
        tally.counts.update(saved.get("counts") or {})
        tally.examples = dict(saved.get("examples") or {})
        return tally

    def skip(self, reason: str, path: str, line: int, detail: str, keep: int) -> None:
        self.counts[reason] += 1
        found = self.examples.setdefault(reason, [])
        if len(found) < keep:
            found.append([path, line, detail[:300]])


COUNTS = ("records", "samples", "tokens", "target_tokens", "truncated", "dropped_long",
          "no_target", "rows")
"""ChatTally's numbers, as a shard's entry records them (where a re-run resumes)."""


def fit(ids: np.ndarray, mask: np.ndarray, capacity: int, overlong: str,
        tally: ChatTally) -> Optional[Sample]:
    """The sample as it goes into a row, or None (counted) when it does not."""
    if len(ids) > capacity:
        if overlong == "drop":
            tally.dropped_long += 1
            return None
        ids, mask = ids[:capacity], mask[:capacity]
        tally.truncated += 1
    if len(ids) < 2 or not mask[1:].any():  # the first token is never a label
        tally.no_target += 1
        return None
    return Sample(ids, mask)


def check_settings(cfg) -> None:
    """ConfigError (exit 2) for what format=chat cannot run with, every problem at once."""
    problems = []
    if cfg.seq_length <= 0:
        problems.append("seq_length=0: format=chat packs rows of seq_length + 1 tokens; set "
                        "seq_length to the model's (e.g. seq_length=4096)")
    if str(cfg.tokenizer.kind) != "hf" or not cfg.tokenizer.path:
        problems.append(f"tokenizer.kind={cfg.tokenizer.kind}: format=chat renders with a Hugging "
                        "Face tokenizer and chat template; set tokenizer.kind=hf "
                        "tokenizer.path=<tokenizer directory>")
    if cfg.chat.pack_window < 1:
        problems.append(f"chat.pack_window={cfg.chat.pack_window}: use 1 or more")
    multiple = cfg.chat.pack_multiple
    if multiple < 1 or (multiple > 1 and cfg.seq_length % multiple):
        problems.append(f"chat.pack_multiple={multiple}: use 1, or a divisor of "
                        f"seq_length={cfg.seq_length} (2 x the context-parallel size)")
    if problems:
        raise ConfigError("; ".join(problems))


@dataclass
class ChatTask:
    """Which share of the inputs this run prepares, and the names it writes under."""

    num_tasks: int
    task_index: int
    name: str
    """The output's name (``name``, or the output directory's), the same for every task."""

    @property
    def stem(self) -> str:
        """Shard names are <stem>_<NNNNN>; array tasks put their index into it."""
        from data_prep.manifest import shard_stem

        return shard_stem(self.name, self.num_tasks, self.task_index)

    @property
    def manifest(self) -> str:
        from data_prep.manifest import manifest_name

        return manifest_name(self.num_tasks, self.task_index)

    @classmethod
    def of(cls, cfg, out_dir: str) -> "ChatTask":
        from data_prep.plan import default_name, task_layout

        num_tasks, task_index = task_layout(cfg.num_tasks, cfg.task_index)
        return cls(num_tasks, task_index, default_name(out_dir, cfg.name))


def chat_files(cfg, task: ChatTask) -> list:
    """This task's JSONL and Parquet inputs (every one for a single run)."""
    from data_prep.inputs import expand_inputs, split_for_task

    files = expand_inputs(cfg.input, "auto", exclude_dir=os.path.abspath(cfg.output))
    other = [f.path for f in files if f.format not in ("jsonl", "parquet")]
    if other:
        raise ConfigError(f"format=chat reads JSONL or Parquet conversations; not one of them: "
                          f"{', '.join(other[:5])}" + (" ..." if len(other) > 5 else ""))
    return split_for_task(files, task.num_tasks, task.task_index)


def row_capacity(cfg) -> int:
    """Tokens a row holds for packing: seq_length + 1 (the last one is only a label), or
    seq_length when conversations are packed at a multiple (the row keeps room to pad each)."""
    return cfg.seq_length + 1 if cfg.chat.pack_multiple == 1 else cfg.seq_length


def packed_length(length: int, multiple: int) -> int:
    """The room a conversation of ``length`` tokens takes in a row packed at ``multiple``."""
    return -(-length // multiple) * multiple


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
"""The files of a tokenizer directory that transformers reads for a fast tokenizer and its
chat template (the weights beside them are not read)."""


def tokenizer_digest(json_file: str) -> str:
    """SHA-256 over the name and bytes of each tokenizer file: ``json_file`` and, when it is a
    directory's tokenizer.json, the other :data:`TOKENIZER_FILES` there."""
    path = Path(json_file)
    files = ([path.parent / name for name in TOKENIZER_FILES]
             if path.name == "tokenizer.json" else [path])
    digest = hashlib.sha256()
    for file in files:
        if file.is_file():
            digest.update(file.name.encode() + b"\0")
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            digest.update(b"\0")
    return digest.hexdigest()


def fingerprint(cfg, files, tokenizer, stem: str) -> str:
    """What the output depends on: inputs (path, size, mtime), the tokenizer's files (their
    bytes), the template's text, the settings, and the shard names (an array task's). An edited
    .jinja file or tokenizer is another run, never a resumed or finished one."""
    parts = [f"{f.path}|{f.size}|{f.mtime_ns}" for f in files] + [stem,
        tokenizer_digest(tokenizer.json_file), tokenizer.template_name,
        hashlib.sha256(str(tokenizer.template_text).encode()).hexdigest(), str(cfg.chat.mask),
        str(cfg.chat.pack), str(cfg.chat.overlong), str(cfg.seq_length),
        str(cfg.chat.pack_window), str(cfg.shard_bytes)] + (
        [f"multiple={cfg.chat.pack_multiple}"] if cfg.chat.pack_multiple > 1 else [])
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _flush(window: List[Sample], shards: ChatShards, capacity: int, pack: bool,
           tally: ChatTally, on_commit: Callable[[], None], last: bool = False,
           multiple: int = 1) -> None:
    """Pack the window's samples (or a row each; each taking its length rounded up to
    ``multiple``) and write them; commit the shard when it is full (or ``last``), then
    ``on_commit`` (the manifest: a re-run resumes after this shard)."""
    if window:
        rows = best_fit_decreasing([packed_length(len(s.ids), multiple) for s in window],
                                   capacity).rows if pack else [[i] for i in range(len(window))]
        shards.add(window, rows)
        tally.rows += len(rows)
        window.clear()
    if shards.full or last:
        if shards.commit(tally=tally.to_dict()) is not None:
            on_commit()


def take_result(result: tuple, cfg, capacity: int, tally: ChatTally) -> Optional[Sample]:
    """One rendered record counted: its sample, or None (skipped, dropped)."""
    path, line, ids, mask, reason, detail = result
    tally.records += 1
    if reason:
        if cfg.strict:
            raise BadDataError(f"{path}:{line}: {reason}: {detail} (strict=true)")
        tally.skip(reason, path, line, detail, cfg.examples_per_reason)
        return None
    sample = fit(ids, mask, capacity, str(cfg.chat.overlong), tally)
    if sample is not None:
        tally.samples += 1
        tally.tokens += len(sample.ids)
        tally.target_tokens += int(sample.mask[1:].sum())
    return sample


def _write_all(files, cfg, shards: ChatShards, tally: ChatTally,
               on_commit: Callable[[], None]) -> None:
    """Every record after those the kept shards hold (``tally.records``), into shards."""
    capacity, window, multiple = row_capacity(cfg), [], cfg.chat.pack_multiple
    last = time.monotonic()
    for result in rendered(files, cfg, skip=tally.records):
        sample = take_result(result, cfg, capacity, tally)
        if sample is not None:
            window.append(sample)
        if len(window) >= cfg.chat.pack_window:
            _flush(window, shards, capacity, cfg.chat.pack, tally, on_commit, multiple=multiple)
        if cfg.progress and time.monotonic() - last >= max(1.0, cfg.progress_every_s):
            last = time.monotonic()
            print(f"data_prep: {tally.records:,} conversations read, {tally.samples:,} kept, "
                  f"{tally.tokens:,} tokens", file=sys.stderr, flush=True)
    _flush(window, shards, capacity, cfg.chat.pack, tally, on_commit, last=True,
           multiple=multiple)


def chat_manifest(cfg, files, tally: ChatTally, shards: ChatShards, tokenizer, task: ChatTask,
                  identity: str, wall: float, dtype, complete: bool = True) -> dict:
    import data_prep

    capacity = cfg.seq_length + 1
    bad = sum(tally.counts.values())
    return {
        "tool": "data_prep", "version": data_prep.__version__, "format": "chat",
        "complete": complete, "name": task.name,
        "task": {"index": task.task_index, "count": task.num_tasks},
        "wall_time_s": round(wall, 3),
        "dtype": np.dtype(dtype).name, "eod_id": int(tokenizer.eot_ids[0]),
        "tokenizer": {"path": os.path.abspath(tokenizer.json_file), "kind": "hf",
                      "directory": os.path.abspath(cfg.tokenizer.path),
                      "vocab_size": tokenizer.vocab_size},
        "chat": {"template": tokenizer.template_name, "template_text": tokenizer.template_text,
                 "mask": str(cfg.chat.mask),
                 "pack": bool(cfg.chat.pack), "overlong": str(cfg.chat.overlong),
                 "pack_multiple": int(cfg.chat.pack_multiple),
                 "seq_length": cfg.seq_length, "row_tokens": capacity,
                 "end_of_turn_ids": [int(i) for i in tokenizer.eot_ids],
                 "packing_efficiency": round(tally.tokens / (tally.rows * capacity), 6)
                 if tally.rows else 0.0},
        "inputs": [{"path": f.path, "size": f.size, "format": f.format} for f in files],
        "totals": {"records": tally.records, "conversations": tally.samples,
                   "rows": tally.rows, "tokens": tally.tokens,
                   "target_tokens": tally.target_tokens, "truncated": tally.truncated,
                   "dropped_long": tally.dropped_long, "no_target": tally.no_target,
                   "bad_records": bad, "skipped": dict(tally.counts),
                   "examples": tally.examples, "shards": len(shards.entries)},
        "shards": shards.entries, "fingerprint": identity}


def execute_chat(cfg) -> dict:
    """Run format=chat (or resume it); the manifest. Raises DataPrepError subclasses
    (ConfigError: exit 2). The output is locked from the first write to the end."""
    from data_prep.output_lock import OutputLock, lock_name
    from launcher.core.chat_render import ChatError, ChatTokenizer

    started = time.perf_counter()
    check_settings(cfg)
    out_dir = os.path.abspath(cfg.output)
    task = ChatTask.of(cfg, out_dir)
    files = chat_files(cfg, task)
    try:
        tokenizer = ChatTokenizer(cfg.tokenizer.path, cfg.chat.template)
    except ChatError as exc:
        raise ConfigError(str(exc)) from None
    os.makedirs(out_dir, exist_ok=True)
    lock = OutputLock(out_dir, lock_name(task.num_tasks, task.task_index))
    lock.acquire()
    try:
        return _run(cfg, files, tokenizer, out_dir, task, started)
    finally:
        lock.release()


def _starting_point(cfg, out_dir: str, task: ChatTask, identity: str):
    """(the previous manifest when it is this run's and complete, the shards kept, the tally
    after them): an interrupted run of the same inputs and settings resumes after its last whole
    shard; another run's output needs overwrite=true."""
    from data_prep.manifest import load_manifest

    previous = load_manifest(os.path.join(out_dir, task.manifest))
    if previous and previous.get("fingerprint") == identity:
        if previous.get("complete"):
            return previous, [], None
        kept = intact_prefix(out_dir, previous.get("shards") or [])
        tally = ChatTally.from_dict(kept[-1]["tally"]) if kept else ChatTally()
        return None, kept, tally
    if previous and not cfg.overwrite:
        raise ConfigError(f"{out_dir} holds the output of another run (other inputs or "
                          "settings); set overwrite=true to replace it, or use another output")
    return None, [], ChatTally()


def _run(cfg, files, tokenizer, out_dir: str, task: ChatTask, started: float) -> dict:
    from data_prep.assemble import token_dtype
    from data_prep.manifest import write_manifest

    stem = task.stem
    identity = fingerprint(cfg, files, tokenizer, stem)
    done, kept, tally = _starting_point(cfg, out_dir, task, identity)
    if done is not None:
        return done
    if kept:
        print(f"data_prep: resuming after {len(kept)} shard(s) ({tally.records:,} records) of an "
              "interrupted run", file=sys.stderr)
    remove_other_files(out_dir, stem, kept)
    dtype = token_dtype(tokenizer.vocab_size)
    shards = ChatShards(out_dir, stem, dtype, cfg.shard_bytes, kept)
    path = os.path.join(out_dir, task.manifest)

    def manifest(complete: bool) -> dict:
        return chat_manifest(cfg, files, tally, shards, tokenizer, task, identity,
                             time.perf_counter() - started, dtype, complete=complete)

    try:
        _write_all(files, cfg, shards, tally, lambda: write_manifest(path, manifest(False)))
    except BaseException:
        shards.abandon()
        raise
    if not tally.samples and task.num_tasks == 1:  # an array task may have none: merge judges
        raise no_conversation_error(len(files), tally.to_dict())
    final = manifest(True)
    write_manifest(path, final)
    if task.num_tasks == 1:
        write_chat_data_config(out_dir, final, cfg.split)
    return final


def no_conversation_error(files: int, tally: dict) -> BadDataError:
    """The error of a run (``tally``: ChatTally.to_dict()) or a merge (``tally``: the merged
    totals) that kept no conversation."""
    skipped = tally.get("counts") or tally.get("skipped") or {}
    return BadDataError(f"no conversation to train on in {files} file(s): skipped "
                        f"{dict(skipped)}, no trained token "
                        f"{tally.get('no_target', 0)}, too long {tally.get('dropped_long', 0)}")



def write_chat_data_config(out_dir: str, manifest: dict, split: str) -> None:
    from data_prep.data_config import data_config, write_data_config

    config = data_config(manifest["name"], out_dir, manifest["shards"], split,
                         manifest["eod_id"], manifest["tokenizer"]["path"])
    config["format"] = "chat"
    write_data_config(out_dir, config)


def print_chat_summary(manifest: dict) -> None:
    t, c = manifest["totals"], manifest["chat"]
    print(f"{t['conversations']:,} of {t['records']:,} conversations in {t['rows']:,} rows of "
          f"{c['row_tokens']:,} tokens ({c['packing_efficiency']:.2%} packed): {t['tokens']:,} "
          f"tokens, {t['target_tokens']:,} trained (mask={c['mask']}, template "
          f"{c['template']}); truncated {t['truncated']:,}, too long {t['dropped_long']:,}, "
          f"nothing to train {t['no_target']:,}, skipped {t['bad_records']:,}")
    for reason, examples in t["examples"].items():
        for path, line, detail in examples:
            print(f"  {reason}: {path}:{line}: {detail}", file=sys.stderr)
