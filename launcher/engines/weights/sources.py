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
from launcher.engines.weights import mapping
from launcher.engines.weights.hf_config import model_fields
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
        """One HF tensor by name."""
        from safetensors import safe_open

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
        return tuple(self.meta[key].size[len(index):])

    def tensors(self, requests: Iterable[tuple[str, tuple]]) -> dict:
        """{(key, index): tensor} for several tensors in one read."""
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
        return {(key, index): state[f"{key}@{index}"].reshape(self.shape(key, index))
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
    """An engine=deepspeed step directory at TP=1 (DeepSpeed has no pipeline here)."""

    def __init__(self, step_dir: Path):
        self.step_dir = Path(step_dir)
        self.model = _model_of(self.step_dir)
        self.dims = ResolvedModel.of_fields(self.model)
        if any(self.step_dir.glob("*mp_rank_01_*")):
            raise SourceError(f"{self.step_dir}: a DeepSpeed checkpoint with tensor parallelism "
                              "(mp_rank_01); export reads DeepSpeed checkpoints at TP=1. Train "
                              "with engine=megatron for TP > 1, whose checkpoints export at "
                              "any layout")
        self.weights = self._weights()
        self.names = {address(name): name for name in self.weights}

    def _weights(self) -> dict:
        zero3 = sorted(self.step_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
        if zero3:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with compat.checkpoint_loads_without_code():
                return get_fp32_state_dict_from_zero_checkpoint(
                    str(self.step_dir.parent), tag=self.step_dir.name, lazy_mode=True)
        file = self.step_dir / "mp_rank_00_model_states.pt"
        if not file.is_file():
            raise SourceError(f"{self.step_dir}: no mp_rank_00_model_states.pt (not a DeepSpeed "
                              "checkpoint)")
        return unpickle.load(file, map_location="cpu", mmap=True)["module"]

    def shape(self, key: str, index: tuple) -> tuple:
        return tuple(self.weights[self.names[(key, index)]].shape)

    def tensor(self, key: str, index: tuple, shape: Optional[tuple] = None) -> torch.Tensor:
        value = self.weights[self.names[(key, index)]]
        if not torch.is_tensor(value):
            value = value.contiguous()  # ZeRO-3 lazy tensor
        return _pad_rows(value, shape)


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
