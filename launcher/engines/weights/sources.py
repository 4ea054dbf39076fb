"""Weight sources: where the tensors of a model come from, one tensor at a time.

Every source answers ``tensor(key, index, shape)``: the whole Megatron-Core tensor of ``key`` at
``index`` along its stacked axes (see :mod:`launcher.engines.weights.mapping`), read lazily so that only
that tensor is in memory. ``shape`` (optional) is the caller's padded shape for vocabulary
tensors. ``model`` holds the ModelConfig fields of the weights.

* :class:`HFSource`: a Hugging Face directory (``config.json`` + safetensors, sharded or not);
* :class:`MegatronSource`: an engine=megatron step directory (torch_dist; any TP/PP/VPP/EP);
* :class:`DeepSpeedSource`: an engine=deepspeed step directory (ZeRO 0-2: the module weights of
  ``mp_rank_00_model_states.pt``, memory-mapped; ZeRO 3: the fp32 partitions, merged lazily).

:func:`open_source` picks one for a path (an HF directory, a run directory, its ``checkpoints``
directory or a step directory).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Iterable, Optional

import torch

from launcher.engines import compat, unpickle
from launcher.engines.deepspeed.files import TP_SPLIT_FILE, saved_layout
from launcher.engines.weights import mapping
from launcher.engines.weights.hf_config import check_weights, model_fields
from launcher.shape import ResolvedModel


class SourceError(ValueError):
    """A path that holds no convertible weights, or weights that cannot be read; the message
    names the path and what to do."""


def _pad_rows(t: torch.Tensor, shape: Optional[tuple]) -> torch.Tensor:
    """``t`` padded to the caller's vocabulary rows (``shape``: its global shape, or None)."""
    return mapping.pad_rows(t, shape[0] if shape and t.dim() == len(shape) else 0)


class HFSource:
    """A Hugging Face model directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        config_file = self.path / "config.json"
        self.config = json.loads(config_file.read_text())
        self.model = model_fields(self.config, str(config_file))
        self.dims = ResolvedModel.of_fields(self.model)
        check_weights(self.config, self.path, self.dims.layers)
        self.rules = mapping.by_key(self.dims)
        self.files = self._weight_map()
        self._open: dict = {}

    def _weight_map(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.path / file for name, file in weight_map.items()}
        single = self.path / "model.safetensors"
        if not single.is_file():
            raise SourceError(f"{self.path}: no model.safetensors or model.safetensors.index."
                              "json (only safetensors weights are read; save the model with "
                              "save_pretrained(..., safe_serialization=True))")
        from safetensors import safe_open

        with safe_open(str(single), "pt") as handle:
            return {name: single for name in handle.keys()}

    def read(self, name: str) -> torch.Tensor:
        """One HF tensor by name (a language model's name: a multimodal Gemma 3 keeps it under
        ``language_model.``)."""
        from safetensors import safe_open

        if name not in self.files and "language_model." + name in self.files:
            name = "language_model." + name
        if name not in self.files:
            raise SourceError(f"{self.path}: tensor {name!r} is missing (is config.json's "
                              f"model_type={self.config.get('model_type')!r} right?)")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), "pt")
        return self._open[file].get_tensor(name)

    def tensor(self, key: str, index: tuple, shape: Optional[tuple] = None) -> torch.Tensor:
        rows = shape[0] if shape else 0
        return mapping.to_canonical(self.rules[key], index, self.read, self.dims, rows)


def checkpoint_meta(step_dir: Path) -> dict:
    meta = Path(step_dir) / "trainwright.json"
    if not meta.is_file():
        raise SourceError(f"{step_dir}: no trainwright.json (not a trainwright checkpoint step "
                          "directory)")
    return json.loads(meta.read_text())


def _model_of(step_dir: Path) -> dict:
    config = checkpoint_meta(step_dir).get("config") or {}
    if not isinstance(config.get("model"), dict):
        raise SourceError(f"{step_dir}/trainwright.json records no model config")
    return dict(config["model"])


class RegionLoadPlanner:
    """torch DCP load planner that reads one region (offsets, sizes) of each saved tensor into
    the state dict's tensor of that region's shape (torch's default planner reads whole tensors;
    Megatron-Core's reader wants every fragment of a sharded read on some rank)."""

    def __new__(cls, regions: dict):
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        class _Planner(DefaultLoadPlanner):
            def create_local_plan(self):
                items = []
                for name, (key, offsets, sizes) in regions.items():
                    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                    for item in create_read_items_for_chunk_list(
                            key, self.metadata.state_dict_metadata[key], [chunk]):
                        items.append(dataclasses.replace(
                            item, dest_index=dataclasses.replace(item.dest_index, fqn=name,
                                                                 offset=None, index=None)))
                return LoadPlan(items)

        return _Planner(allow_partial_load=True)


class MegatronSource:
    """An engine=megatron step directory (torch_dist), read region by region with torch's
    distributed-checkpoint reader in this one process (no process group): a layer's slice of a
    stacked tensor is planned as one chunk (:class:`RegionLoadPlanner`), so nothing beyond the
    requested tensors is read."""

    def __init__(self, step_dir: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.step_dir = Path(step_dir)
        self.path = self.step_dir / "megatron"
        self.model = _model_of(self.step_dir)
        self.dims = ResolvedModel.of_fields(self.model)
        with compat.checkpoint_loads_without_code():
            self.meta = FileSystemReader(str(self.path)).read_metadata().state_dict_metadata

    def shape(self, key: str, index: tuple) -> tuple:
        key, index = mapping.stored_key(key, index, self.dims)
        return tuple(self.meta[key].size[len(index):])

    def tensors(self, requests: Iterable[tuple[str, tuple]]) -> dict:
        """{(key, index): tensor} for several tensors in one read."""
        requests = list(requests)
        stored = [mapping.stored_key(key, index, self.dims) for key, index in requests]
        found = self._read(stored)
        return {request: found[at] for request, at in zip(requests, stored)}

    def _read(self, requests: list[tuple[str, tuple]]) -> dict:
        """{(stored key, index): tensor} in one read."""
        from torch.distributed.checkpoint import FileSystemReader, load

        regions, state = {}, {}
        for key, index in requests:
            if key not in self.meta:
                raise SourceError(f"{self.path}: no tensor {key!r} (a checkpoint of another "
                                  "model? its trainwright.json says "
                                  f"{self.model.get('name')})")
            full = tuple(self.meta[key].size)
            sizes = (1,) * len(index) + full[len(index):]
            state[f"{key}@{index}"] = torch.empty(sizes, dtype=self.meta[key].properties.dtype)
            regions[f"{key}@{index}"] = (key, tuple(index) + (0,) * (len(full) - len(index)),
                                         sizes)
        with compat.checkpoint_loads_without_code():
            load(state, storage_reader=FileSystemReader(str(self.path)),
                 planner=RegionLoadPlanner(regions), no_dist=True)
        return {(key, index): state[f"{key}@{index}"].reshape(self.meta[key].size[len(index):])
                for key, index in requests}

    def tensor(self, key: str, index: tuple, shape: Optional[tuple] = None) -> torch.Tensor:
        return _pad_rows(self.tensors([(key, index)])[(key, index)], shape)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""Megatron-Core's local layer spec saves its norms under the TE-fused names
(``sharded_state_dict_keys_map`` in gpt_layer_specs.py); parameter names keep the local ones."""


def address(name: str) -> tuple[str, tuple]:
    """Megatron-Core parameter name (one TP=1, PP=1, EP=1 model) -> (key, index)."""
    match = _LAYER.match(name)
    if not match:
        return name, ()
    layer, rest = int(match.group(1)), match.group(2)
    expert = _EXPERT.match(rest)
    if expert:
        return mapping.EXPERTS + expert.group(2), (layer, int(expert.group(1)))
    for local, fused in _FUSED_NORMS.items():
        if rest.startswith(local):
            rest = fused + rest[len(local):]
    return mapping.L + rest, (layer,)


class DeepSpeedSource:
    """An engine=deepspeed step directory at any tensor-parallel size (DeepSpeed has no
    pipeline here): each TP rank's module weights (ZeRO 0-2: ``mp_rank_<t>_model_states.pt``,
    memory-mapped; ZeRO 3: the fp32 partitions, merged lazily), and at TP > 1 the TP shards of
    each tensor merged as the writer recorded their split (``tensor_parallel.json``)."""

    def __init__(self, step_dir: Path):
        self.step_dir = Path(step_dir)
        self.model = _model_of(self.step_dir)
        self.dims = ResolvedModel.of_fields(self.model)
        tp = saved_layout(self.step_dir)["tp"]
        if tp is None:
            raise SourceError(f"{self.step_dir}: no mp_rank_00_model_states.pt (not a "
                              "DeepSpeed checkpoint)")
        self.split = {}
        if tp > 1:
            split_file = self.step_dir / TP_SPLIT_FILE
            if not split_file.is_file():
                raise SourceError(f"{self.step_dir}: a DeepSpeed checkpoint at TP={tp} without "
                                  f"{TP_SPLIT_FILE} (written before trainwright recorded how "
                                  "its tensors are split); resume it at TP={tp} to save it again")
            self.split = json.loads(split_file.read_text())
        self._views: list = []  # temporary directories a ZeRO-3 read at TP > 1 reads through
        self.shards = [self._weights(rank, tp) for rank in range(tp)]
        self.names = {address(name): name for name in self.shards[0]}

    def _weights(self, tp_rank: int, tp: int) -> dict:
        """The module weights of one TP rank, by parameter name."""
        zero3 = sorted(self.step_dir.glob(f"zero_pp_rank_*_mp_rank_{tp_rank:02d}_model_states.pt"))
        if zero3:
            return _zero3_weights(self.step_dir, tp_rank, tp, self._views)
        file = self.step_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"
        return unpickle.load(file, map_location="cpu", mmap=True)["module"]

    def shape(self, key: str, index: tuple) -> tuple:
        return tuple(self._merged(self.names[(key, index)]).shape)

    def _merged(self, name: str) -> torch.Tensor:
        parts = [_materialised(shard[name]) for shard in self.shards]
        if name not in self.split:
            return parts[0]
        axis, glu = self.split[name]
        return merge_tensor_parallel(parts, axis, glu)

    def tensor(self, key: str, index: tuple, shape: Optional[tuple] = None) -> torch.Tensor:
        return _pad_rows(self._merged(self.names[(key, index)]), shape)


def _materialised(value) -> torch.Tensor:
    """A tensor of a weights dict (a ZeRO-3 lazy tensor is read now)."""
    return value if torch.is_tensor(value) else value.contiguous()


def merge_tensor_parallel(parts: list[torch.Tensor], axis: int, glu: bool) -> torch.Tensor:
    """The whole tensor from its TP shards, concatenated along ``axis``; ``glu``: each shard is
    [gate; up] of its rows, so the gates come first, then the ups."""
    if glu:
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=axis)


def _zero3_weights(step_dir: Path, tp_rank: int, tp: int, views: list) -> dict:
    """One TP rank's fp32 weights of a ZeRO-3 checkpoint (DeepSpeed's zero_to_fp32, lazily),
    read at TP > 1 through a temporary view of the step directory that holds that rank's files
    only (zero_to_fp32 merges every file it finds as data-parallel partitions of one model);
    the view is appended to ``views``, which must live as long as the weights are read."""
    import tempfile

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if tp == 1:
        view = step_dir
    else:
        views.append(tempfile.TemporaryDirectory(prefix=f"tw_tp{tp_rank}_"))
        view = Path(views[-1].name) / step_dir.name
        view.mkdir()
        for file in step_dir.glob(f"*mp_rank_{tp_rank:02d}_*"):
            (view / file.name).symlink_to(file.resolve())
    with compat.checkpoint_loads_without_code():
        return get_fp32_state_dict_from_zero_checkpoint(str(view.parent), tag=view.name,
                                                        lazy_mode=True)


def step_dir_of(path: Path) -> Path:
    """A step directory for a run directory, its ``checkpoints`` directory or a step directory
    (the latest complete step when given a run or checkpoints directory)."""
    from launcher.core.checkpoints import find_resume

    path = Path(path)
    if (path / "trainwright.json").is_file():
        return path
    run_dir = path.parent if path.name == "checkpoints" else path
    resume = find_resume(run_dir) if (run_dir / "checkpoints").is_dir() else None
    if resume is None:
        raise SourceError(f"{path}: not a Hugging Face model directory (no config.json) and no "
                          "complete trainwright checkpoint (no trainwright.json, no "
                          "checkpoints/latest)")
    return Path(resume.path)


def open_source(path: Path):
    """The weight source at ``path`` (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise SourceError(f"{path} does not exist")
    if (path / "config.json").is_file():
        return HFSource(path)
    step_dir = step_dir_of(path)
    if (step_dir / "megatron").is_dir():
        return MegatronSource(step_dir)
    return DeepSpeedSource(step_dir)


TOKENIZER_DIR = "tokenizer"
"""Inside a step directory: the tokenizer that travels with the checkpoint (launcher.convert
from_hf copies the Hugging Face model's there), its chat template in tokenizer_config.json."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
"""The files of a Hugging Face directory that make its tokenizer (and chat template)."""


def tokenizer_files(hf_dir: Path) -> dict:
    """``tokenizer/<name>`` -> path of each tokenizer file of ``hf_dir`` (empty without a
    tokenizer.json: nothing this project reads)."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "tokenizer.json").is_file():
        return {}
    return {f"{TOKENIZER_DIR}/{name}": hf_dir / name for name in TOKENIZER_FILES
            if (hf_dir / name).is_file()}


def step_tokenizer(step_dir: Path) -> Optional[Path]:
    """The tokenizer.json of a checkpoint: the one kept in its step directory, else the one
    its run was prepared with (:func:`tokenizer_file`); None when there is none."""
    kept = Path(step_dir) / TOKENIZER_DIR / "tokenizer.json"
    return kept if kept.is_file() else tokenizer_file(checkpoint_meta(Path(step_dir)))


def tokenizer_file(meta: dict) -> Optional[Path]:
    """The run's HF ``tokenizer.json`` (data.tokenizer_path, or the tokenizer named by the
    manifest next to its first data prefix); None for other kinds or mock data."""
    data = (meta.get("config") or {}).get("data") or {}
    candidates = [data.get("tokenizer_path") or ""]
    for prefix in data.get("prefixes") or []:
        manifest = Path(prefix).parent / "manifest.json"
        if manifest.is_file():
            tok = json.loads(manifest.read_text()).get("tokenizer") or {}
            if tok.get("kind") == "hf":
                candidates.append(tok.get("path") or "")
    for candidate in candidates:
        if candidate and Path(candidate).name.endswith(".json") and Path(candidate).is_file():
            return Path(candidate)
    return None


def chat_template_text(meta: dict) -> str:
    """The chat template the run's conversations were rendered with (data.format=chat: the
    manifest next to its first data prefix records it); '' for any other run."""
    data = (meta.get("config") or {}).get("data") or {}
    for prefix in data.get("prefixes") or []:
        manifest = Path(prefix).parent / "manifest.json"
        if manifest.is_file():
            return ((json.loads(manifest.read_text()).get("chat") or {})
                    .get("template_text") or "")
    return ""
