"""``launcher.convert to_hf``: a trainwright checkpoint -> a Hugging Face model directory.

Reads either engine's checkpoint (:mod:`launcher.engines.weights.sources`), maps every Megatron-Core
tensor to its HF tensors (:mod:`launcher.engines.weights.mapping`) layer by layer and streams them into
safetensors shards (:mod:`launcher.convert.hf_writer`); then writes ``config.json``,
``generation_config.json`` and, when the run's tokenizer is a Hugging Face ``tokenizer.json``,
the tokenizer files. Runs in one CPU process; no GPU, no model is built.
"""

from __future__ import annotations

import itertools
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from launcher.convert import hf_writer
from launcher.core.atomic import atomic_write_json
from launcher.engines.weights import mapping
from launcher.engines.weights.hf_config import UnsupportedModel
from launcher.engines.weights.hf_export import export_problems, hf_config
from launcher.engines.weights.sources import chat_template_text, checkpoint_meta, tokenizer_file
from launcher.shape import ResolvedModel


def _layer_groups(dims: ResolvedModel):
    """entries() grouped so that one group is read at once (embedding, each layer, the rest)."""
    def group(item):
        rule, index = item
        return index[0] if index else (-1 if rule.key.startswith("embedding.") else dims.layers)
    return [list(items) for _, items in itertools.groupby(mapping.entries(dims), key=group)]


def _read_group(source, items: list) -> dict:
    requests = [(rule.key, index) for rule, index in items]
    if hasattr(source, "tensors"):
        return source.tensors(requests)
    return {r: source.tensor(*r) for r in requests}


def _hf_sizes(source, dims: ResolvedModel, dtype: Optional[torch.dtype]) -> list:
    """(HF name, bytes) of every output tensor, from shapes only (meta tensors)."""
    sizes = []
    for rule, index in mapping.entries(dims):
        meta = torch.empty(source.shape(rule.key, index), device="meta",
                           dtype=dtype or torch.float32)
        for name, t in mapping.to_hf(rule, index, meta, dims):
            sizes.append((name, t.numel() * t.element_size()))
    return sizes


def convert_tensors(source, out: Path, *, dtype: Optional[torch.dtype], max_shard_bytes: int,
                    progress: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Stream every tensor of ``source`` into HF shards under ``out``; the output dtype."""
    dims = source.dims
    writer = hf_writer.ShardedWriter(out, hf_writer.plan_shards(
        _hf_sizes(source, dims, dtype), max_shard_bytes))
    seen_dtype = None
    groups = list(_layer_groups(dims))
    for done, items in enumerate(groups, 1):
        tensors = _read_group(source, items)
        for rule, index in items:
            tensor = tensors.pop((rule.key, index))
            tensor = tensor.to(dtype) if dtype is not None else tensor
            seen_dtype = tensor.dtype
            for name, part in mapping.to_hf(rule, index, tensor, dims):
                writer.add(name, part)
        progress(done, len(groups))
    writer.finish()
    return {"dtype": seen_dtype, "bytes": writer.total_bytes, "shards": len(writer.files)}


def write_tokenizer(tokenizer_json: Path, out: Path, eod_id: int, chat_template: str = "") -> dict:
    """tokenizer.json + tokenizer_config.json (with ``chat_template``: a fine-tuned run's, so
    transformers renders conversations as the model was trained); the special token ids found."""
    import tokenizers

    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    eos = tok.id_to_token(eod_id) if eod_id >= 0 else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": 1_000_000_000}
    if eos:
        config["eos_token"] = eos
    if chat_template:
        config["chat_template"] = chat_template
    atomic_write_json(out / "tokenizer_config.json", config)
    return {"eos": eod_id if eos else -1}


def export(source, step_dir: Path, out: Path, *, dtype_name: str = "auto",
           max_shard_gb: float = 5.0, log: Callable[[str], None] = print) -> dict:
    """Write the HF directory ``out`` from ``source`` (opened on ``step_dir``); a summary.
    A model no Hugging Face family holds is refused before anything is written."""
    problems = export_problems(source.model)
    if problems:
        raise UnsupportedModel(str(step_dir), problems)
    start = time.perf_counter()
    meta = checkpoint_meta(step_dir)
    partial = hf_writer.staging_dir(out)
    dtype = None if dtype_name == "auto" else hf_writer.DTYPES[dtype_name]
    report = convert_tensors(
        source, partial, dtype=dtype, max_shard_bytes=int(max_shard_gb * 1e9),
        progress=lambda done, total: log(f"to_hf: {done}/{total} tensor groups written"))
    eod = int(((meta.get("config") or {}).get("data") or {}).get("eod_token_id", -1))
    tokenizer = tokenizer_file(meta)
    eos = write_tokenizer(tokenizer, partial, eod, chat_template_text(meta))["eos"] \
        if tokenizer else -1
    atomic_write_json(partial / "config.json", hf_config(
        source.model, dtype=hf_writer.DTYPE_NAMES[report["dtype"]], eos_id=eos))
    atomic_write_json(partial / "generation_config.json",
                         {"eos_token_id": eos if eos >= 0 else None, "do_sample": False})
    hf_writer.publish(partial, out)
    seconds = time.perf_counter() - start
    return {"out": str(out), "step": meta.get("step"), "bytes": report["bytes"],
            "shards": report["shards"], "seconds": seconds,
            "tokenizer": str(tokenizer) if tokenizer else None}
