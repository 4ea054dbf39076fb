"""Machine profiles: what a probe measured on one node, stored where the plan finds it again.

A profile is one JSON file per machine and rank count in the profile directory
(``plan.profile_dir``; empty: ``$TRAINWRIGHT_PROFILE_DIR``, else
``~/.cache/trainwright/profiles``), written atomically by ``python -m launcher.probe``
(:mod:`launcher.runtime.probe`) and, for the precision check alone, by the plan
(:mod:`launcher.plan.precision`). It says what it was measured on (the device and its model,
the ranks on the node, the threads per rank, the library versions) and holds its figures by
section (``figures``), each figure with the shape or size it was measured at.

The plan reuses a profile only for the machine it describes: the same device (``cluster.gpu``),
the same CPU or GPU model, the same ranks per node and the same versions of torch,
Megatron-Core, DeepSpeed and Transformer Engine (:func:`matching_profile`). A file that is not
a valid profile is refused with one line naming it and the fix, never half-read.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from launcher.core.atomic import atomic_write_json

SCHEMA = 1
"""Version of the profile format; a file of another version is not read."""
PROFILE_DIR_ENV = "TRAINWRIGHT_PROFILE_DIR"
"""Overrides the default profile directory (the test suite points it at a temporary one)."""
REQUIRED = {"schema": int, "created": str, "device": str, "model": str, "ranks": int,
            "threads_per_rank": int, "versions": dict, "figures": dict}
"""Keys every profile has, with their JSON types."""
_KIND = {int: "an integer", str: "a string", dict: "an object"}


class ProfileError(ValueError):
    """A file that is not a usable machine profile; the message names it and the fix."""


@dataclass(frozen=True)
class MachineProfile:
    """One node's measured figures (module docstring)."""

    device: str
    """The catalogue device it was measured on (cluster.gpu: cpu, H100, ...)."""
    model: str
    """The CPU model name (device cpu) or the GPU's name as CUDA reports it."""
    ranks: int
    """Ranks on the node while measuring (cluster.gpus_per_node x ranks_per_gpu)."""
    threads_per_rank: int
    """Intra-op threads of each rank while measuring (OMP_NUM_THREADS)."""
    versions: dict
    """{library: version} (launcher.plan.machine.LIBRARIES)."""
    figures: dict = field(default_factory=dict)
    """{section: measurements}; each section's records carry their shape or size."""
    created: str = ""
    """UTC time of the last measurement written into it (ISO 8601)."""
    source: str = ""
    """What wrote it last: probe, precision check, run <dir>."""
    schema: int = SCHEMA
    path: Optional[Path] = None
    """Where it was read from (not stored)."""

    @property
    def label(self) -> str:
        """``<file name>, <date>`` for the plan's lines."""
        name = self.path.name if self.path is not None else file_name(self)
        return f"{name}, {self.created[:10]}"

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("path")
        return out


def profile_dir(configured: str = "") -> Path:
    """The profile directory: ``configured`` (plan.profile_dir), else $TRAINWRIGHT_PROFILE_DIR,
    else ~/.cache/trainwright/profiles."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get(PROFILE_DIR_ENV):
        return Path(os.environ[PROFILE_DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "trainwright" / "profiles"


def file_name(p: MachineProfile) -> str:
    """``<device>-<model slug>-<ranks>r.json``: one file per machine and rank count."""
    slug = re.sub(r"[^a-z0-9]+", "-", p.model.lower()).strip("-")[:60] or "unknown"
    return f"{p.device.lower()}-{slug}-{p.ranks}r.json"


def read_profile(path: Path) -> MachineProfile:
    """The profile in ``path``; ProfileError naming the file, what is wrong and the fix."""
    path = Path(path)
    fix = "delete it or write it again with python -m launcher.probe"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"{path} cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ProfileError(f"{path} is not a machine profile: {exc}; {fix}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{path} is not a machine profile: a JSON object expected; {fix}")
    for key, kind in REQUIRED.items():
        if not isinstance(raw.get(key), kind) or isinstance(raw.get(key), bool):
            raise ProfileError(f"{path} is not a machine profile: '{key}' is missing or not "
                               f"{_KIND[kind]}; {fix}")
    if raw["schema"] != SCHEMA:
        raise ProfileError(f"{path} has profile schema {raw['schema']}, this trainwright reads "
                           f"{SCHEMA}; {fix}")
    known = {k: raw[k] for k in REQUIRED} | {"source": str(raw.get("source", ""))}
    return MachineProfile(**known, path=path)


def mismatch(p: MachineProfile, *, device: str, model: str, ranks: int,
             versions: dict) -> str:
    """Why ``p`` does not describe this machine ('' when it does)."""
    if p.device.lower() != device.lower():
        return f"measured on {p.device}, the plan is for {device}"
    if model and p.model != model:
        return f"measured on {p.model!r}, this machine is {model!r}"
    if p.ranks != ranks:
        return f"measured with {p.ranks} rank(s) per node, the job runs {ranks}"
    changed = [f"{k} {p.versions.get(k)} -> {v}" for k, v in versions.items()
               if p.versions.get(k) != v]
    return f"other library versions ({', '.join(changed)})" if changed else ""


def matching_profile(directory: Path, *, device: str, model: str, ranks: int,
                     versions: dict) -> tuple[Optional[MachineProfile], list[str]]:
    """(the stored profile of this machine or None, notes on the files passed over: corrupt
    ones, and those of this device measured elsewhere or with other versions)."""
    notes, found = [], None
    directory = Path(directory)
    if not directory.is_dir():
        return None, notes
    for path in sorted(directory.glob("*.json")):
        try:
            p = read_profile(path)
        except ProfileError as exc:
            notes.append(f"ignored {exc}")
            continue
        why = mismatch(p, device=device, model=model, ranks=ranks, versions=versions)
        if not why and found is None:
            found = p
        elif why and p.device.lower() == device.lower():
            notes.append(f"not reused {path.name}: {why}")
    return found, notes


def merge_section(old, new):
    """A section after a new measurement: records (dicts with a ``key``, and a ``layers`` where
    one key is measured at several depths) replace the old ones measured at the same key and
    depth and keep the others; any other section is replaced whole."""
    if not (isinstance(old, list) and isinstance(new, list)):
        return new

    def identity(record) -> str:
        return json.dumps([record.get("key"), record.get("layers")], sort_keys=True)

    replaced = {identity(r) for r in new if isinstance(r, dict)}
    return [r for r in old if isinstance(r, dict) and identity(r) not in replaced] + list(new)


def save_figures(directory: Path, base: MachineProfile, figures: dict, source: str) -> Path:
    """Merge ``figures`` (whole sections) into the stored profile of ``base``'s machine (a new
    one when there is none, or when the stored one is of other versions or unreadable) and
    write it atomically; its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(base)
    merged = dict(figures)
    try:
        old = read_profile(path)
        if not mismatch(old, device=base.device, model=base.model, ranks=base.ranks,
                        versions=base.versions) and old.threads_per_rank == base.threads_per_rank:
            merged = {**old.figures, **{name: merge_section(old.figures.get(name), section)
                                        for name, section in figures.items()}}
    except ProfileError:
        pass
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    atomic_write_json(path, replace(base, figures=merged, created=now, source=source).to_dict())
    return path
