"""Checks of the data a run will read against its config, before anything is launched.

Every shard must be whole: its ``.idx`` readable and its ``.bin`` exactly as long as the index
says (the end of the last sequence). Only the index header and its last entries are read, never
the data, so the check costs milliseconds per shard. A truncated ``.bin`` would otherwise fail
inside every rank's DataLoader after the job started.

data_prep writes ``manifest.json`` beside its shards, naming the tokenizer and its vocabulary
size. Token ids at or above ``model.vocab_size`` would index past the embedding table (a device
assert on a GPU, an IndexError on a CPU, after the job has queued and started), so a tokenizer
larger than the model is refused here, with the manifest's path and the fix. Prefixes without a
manifest (data prepared elsewhere) are not checked.

``s3://`` prefixes (data_prep output=s3://..., docs/data_prep.md "Data on object storage") are
copied into the node's shard cache first (:mod:`launcher.core.shard_cache`) and checked there,
so the ranks then read local files; a dataset that is not committed, a shard or object that is
missing and a store that cannot be read are refused here too (exit 2, naming the URI and key).
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Sequence

from launcher.core.objectstore import is_remote
from launcher.core.remote_data import DataUnavailable

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""The first bytes of a Megatron-Core indexed-dataset ``.idx`` (format version 1)."""
ITEM_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
"""Bytes per token id for each dtype code of the index (megatron.core.datasets.indexed_dataset
DType: uint8, int8, int16, int32, int64, float64, float32, uint16)."""
REBUILD = ("rebuild it with python -m data_prep (manifest.json beside it names the inputs) "
           "or copy it again, or remove the prefix from data.prefixes")


def expected_bin_bytes(idx_path: str) -> int:
    """The ``.bin`` size the index describes: the last sequence's offset + its length in bytes.
    Raises ValueError naming what is wrong with the index."""
    with open(idx_path, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise ValueError("not a Megatron indexed-dataset index (bad header)")
        version, code, sequences = struct.unpack("<QBQ", head[9:26])
        if version != 1 or code not in ITEM_BYTES:
            raise ValueError(f"unknown index version {version} or dtype code {code}")
        if sequences == 0:
            return 0
        need = 34 + sequences * 12
        if os.fstat(f.fileno()).st_size < need:
            raise ValueError(f"index truncated: {sequences} sequences need at least {need} bytes")
        f.seek(34 + (sequences - 1) * 4)
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(34 + sequences * 4 + (sequences - 1) * 8)
        (last_pointer,) = struct.unpack("<q", f.read(8))
    return last_pointer + last_length * ITEM_BYTES[code]


def document_count(idx_path: str) -> int:
    """Documents of a shard, from its index header (its document index has one more entry)."""
    with open(idx_path, "rb") as f:
        head = f.read(34)
    return max(0, struct.unpack("<Q", head[26:34])[0] - 1)


SPLIT_NAMES = ("training", "validation", "test")


def split_problems(prefixes: Sequence[str], split: str) -> list[str]:
    """A split of ``data.split`` that gets no document of a shard: Megatron-Core splits each
    shard by documents (``round(fraction x documents)`` at each boundary) and, asked for
    samples from an empty split, loops forever counting epochs."""
    weights = [float(w) for w in re.findall(r"[.0-9]+", split) if w != "."]  # Megatron's parse
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    total = sum(weights)
    if total <= 0:
        return [f"data.split={split!r} gives no split any weight; use e.g. 98,1,1"]
    bounds = [sum(weights[:i]) / total for i in range(4)]
    problems = []
    for prefix in prefixes:
        try:
            docs = document_count(prefix + ".idx")
        except (OSError, struct.error):
            continue  # named by shard_problems
        for name, weight, beg, end in zip(SPLIT_NAMES, weights, bounds, bounds[1:]):
            if weight > 0 and round(end * docs) - round(beg * docs) == 0:
                problems.append(
                    f"data.split={split} leaves the {name} split no document of {prefix} "
                    f"({docs} documents): Megatron-Core would loop forever building it; give "
                    "that split more weight (e.g. 'data.split=\"80,10,10\"': unquoted, "
                    "Hydra reads the commas as a list) or the shard more documents")
                break
    return problems


def shard_problems(prefixes: Sequence[str]) -> list[str]:
    """One message per shard that is missing, unreadable or not as long as its index says."""
    problems = []
    for prefix in prefixes:
        bin_path, idx_path = prefix + ".bin", prefix + ".idx"
        missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
        if missing:
            problems.append(f"data.prefixes: {', '.join(missing)} does not exist; run data_prep "
                            "for it, or fix data.prefixes")
            continue
        try:
            expected = expected_bin_bytes(idx_path)
        except (OSError, ValueError, struct.error) as exc:
            problems.append(f"{idx_path}: {exc}; {REBUILD}")
            continue
        actual = os.path.getsize(bin_path)
        if actual != expected:
            problems.append(f"{bin_path} is {actual:,} bytes, its index {idx_path} describes "
                            f"{expected:,} (the file is {'truncated' if actual < expected else 'longer'}"
                            f"); {REBUILD}")
    return problems


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
        problems += _vocab_problem(tokenizer, str(path), str(path.parent), vocab_size)
    return problems


def _vocab_problem(tokenizer: dict, path: str, folder: str, vocab_size: int) -> list[str]:
    """The problem of a manifest's ``tokenizer`` against ``vocab_size`` ([] when it fits)."""
    data_vocab = tokenizer.get("vocab_size")
    if not isinstance(data_vocab, int) or data_vocab <= vocab_size:
        return []
    return [f"model.vocab_size={vocab_size} is smaller than the vocabulary of the tokenizer "
            f"that wrote {folder} ({tokenizer.get('kind', '?')} "
            f"{tokenizer.get('path') or tokenizer.get('name') or ''}: vocab_size="
            f"{data_vocab}, see {path}); token ids up to {data_vocab - 1} would index past "
            f"the embedding: set model.vocab_size={data_vocab} (or more)"]


def chat_token_shares(prefixes: Sequence[str]) -> dict:
    """{"real", "trained"}: the shares of the rows' tokens that are conversation and targets,
    over the data_prep format=chat manifests beside ``prefixes`` ({} when none says)."""
    tokens = trained = capacity = 0
    for manifest in local_manifests(prefixes).values():
        totals, chat = manifest.get("totals") or {}, manifest.get("chat") or {}
        if manifest.get("format") != "chat" or not totals.get("rows"):
            continue
        tokens += totals["tokens"]
        trained += totals["target_tokens"]
        capacity += totals["rows"] * chat["row_tokens"]
    return {"real": tokens / capacity, "trained": trained / capacity} if capacity else {}


def local_manifests(prefixes: Sequence[str]) -> dict:
    """{path: content} of the data_prep ``manifest.json`` beside each local prefix (an
    ``s3://`` prefix is checked in the shard cache; an unreadable manifest is left out)."""
    found = {}
    for path in sorted({Path(p).parent / "manifest.json" for p in prefixes if not is_remote(p)}):
        try:
            found[str(path)] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return found


def chat_pack_multiples(prefixes: Sequence[str]) -> dict:
    """{manifest path: chat.pack_multiple} of the data_prep format=chat manifests beside
    ``prefixes`` (1 for a manifest written before the setting)."""
    return {path: int((manifest.get("chat") or {}).get("pack_multiple", 1))
            for path, manifest in local_manifests(prefixes).items()
            if manifest.get("format") == "chat"}


def chat_seq_lengths(prefixes: Sequence[str]) -> dict:
    """{manifest path: the seq_length its chat rows were packed for} (manifests that say)."""
    return {path: int(manifest["chat"]["seq_length"])
            for path, manifest in local_manifests(prefixes).items()
            if manifest.get("format") == "chat" and "seq_length" in (manifest.get("chat") or {})}


def loss_mask_shards(prefixes: Sequence[str]) -> dict:
    """{local prefix: whether its loss mask (``<prefix>.mask.idx``, data_prep format=chat's
    second dataset) is there}, for the prefixes whose ``.idx`` is."""
    return {p: os.path.exists(p + ".mask.idx") for p in prefixes
            if not is_remote(p) and os.path.exists(p + ".idx")}


def check_data_or_exit(prefixes: Sequence[str], vocab_size: int, split: str = "98,1,1", *,
                       cache=None, fetch: bool = True) -> list[str]:
    """Print every problem of :func:`shard_problems`, :func:`split_problems` and
    :func:`vocab_problems` and exit 2 when there is any; the prefixes as the ranks read them.

    ``s3://`` prefixes are first copied into the node's shard cache (``cache``, a
    :class:`launcher.core.shard_cache.ShardCache`; None = :func:`shard_cache` of the defaults)
    and checked there. With ``fetch=False`` (launcher.submit: the job's nodes copy them) they
    are only checked on the store: committed, every object there with its manifest's size, and
    the manifest's vocabulary. A store or dataset that cannot be read exits 2 naming it."""
    try:
        local, on_store = _localized(prefixes, cache, fetch)
    except DataUnavailable as exc:
        _exit_with([f"data.prefixes: {exc}"])
    problems = shard_problems(local)
    problems += split_problems(local, split) if not problems else []
    problems += vocab_problems(local, vocab_size) + _store_vocab_problems(on_store, vocab_size)
    if problems:
        _exit_with(problems)
    return local


def shard_cache(data=None):
    """The shard cache of a DataConfig's ``shard_cache_dir`` and ``shard_cache_gb`` (None: the
    defaults)."""
    from launcher.core.shard_cache import ShardCache

    return ShardCache.at(getattr(data, "shard_cache_dir", ""),
                         getattr(data, "shard_cache_gb", 0.0))


def _localized(prefixes: Sequence[str], cache, fetch: bool) -> tuple[list[str], list]:
    """(the local prefixes to check, the shards checked on the store only): remote prefixes
    copied into ``cache`` when ``fetch``, else resolved on the store and left out."""
    if not fetch and any(is_remote(p) for p in prefixes):
        from launcher.core.remote_data import resolve

        return ([p for p in prefixes if not is_remote(p)],
                resolve([p for p in prefixes if is_remote(p)]))
    if any(is_remote(p) for p in prefixes):
        return (cache or shard_cache()).localize(prefixes), []
    return list(prefixes), []


def _store_vocab_problems(shards: Sequence, vocab_size: int) -> list[str]:
    """:func:`vocab_problems` of the manifests on the store of resolved remote ``shards``."""
    problems = []
    for folder, text in sorted({(str(s.folder), s.manifest) for s in shards}):
        tokenizer = json.loads(text).get("tokenizer") or {}
        problems += _vocab_problem(tokenizer, f"{folder}/manifest.json", folder, vocab_size)
    return problems


def _exit_with(problems: Sequence[str]) -> None:
    from launcher.core.exits import CONFIG_ERROR_EXIT

    print(f"data: {len(problems)} problem(s):\n" + "\n".join(f"- {p}" for p in problems),
          file=sys.stderr)
    raise SystemExit(CONFIG_ERROR_EXIT)
