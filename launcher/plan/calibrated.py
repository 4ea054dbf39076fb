"""The step time composed from a machine profile's measured parts: :class:`Calibration`.

The composition is the step-time model's (:mod:`launcher.plan.step_time`: the slowest stage
sets the pace, the pipeline bubble, the transfers between stages, the data-parallel traffic,
the optimizer), with every rate replaced by what the probe measured on this machine
(:mod:`launcher.runtime.probe`):

* a micro-batch on a stage: its layers x one layer's forward + backward at this tensor-parallel
  size and micro-batch (interpolated linearly in the micro-batch between measured sizes), the
  embedding on the first stage, the output layer and loss on the last;
* tensor parallel: per layer and pass, the measured all-reduce (or all-gather and
  reduce-scatter with sequence parallelism) of the micro-batch's activations;
* pipeline: the measured send/recv of one micro-batch's activations per transfer;
* data parallel: the measured all-reduce (no sharding) or reduce-scatter + all-gather (ZeRO,
  the distributed optimizer) of the stage's gradients and weights, per micro-batch for ZeRO-2/3
  (DeepSpeed), without overlap on a CPU (one core per rank computes or communicates);
* the optimizer: AdamW measured over the rank's shard;
* the framework: what the probe's run of the engine at this layout took beyond all of the above,
  per step (Python, the schedule, hooks, the loss and stop agreements).

Sizes between measured points are interpolated linearly (bytes, parameters, micro-batches) and
extrapolated from the last two points. A layout whose passes were not measured (another model,
a tensor-parallel size the node cannot hold) falls back to the catalogue model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Optional

from launcher.plan.profile import MachineProfile


MODEL_KEYS = ("arch", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "ffn_hidden_size", "vocab_size", "seq_length", "num_experts")
"""The model sizes a figure is keyed by (besides the layers, which it is measured per)."""


def model_key(model: Mapping, precision: str) -> dict:
    """What a pass figure depends on besides the layout: the model's sizes (``model``: the
    config's model group as plain values) and the dtype."""
    return {k: str(model.get(k)) if k == "arch" else model.get(k) for k in MODEL_KEYS} \
        | {"precision": str(precision)}


def layout_key(plan: Mapping, config: Mapping) -> dict:
    """What an engine figure depends on: the engine, its ZeRO stage, the layout's sizes and the
    batch split (``plan``: plan.json; ``config``: the resolved config as plain values)."""
    return {"engine": plan["engine"], "zero_stage": plan["zero_stage"],
            "tp": plan["tensor_parallel_size"], "pp": plan["pipeline_parallel_size"],
            "vpp": plan["virtual_pipeline_parallel_size"], "cp": plan["context_parallel_size"],
            "ep": plan["expert_parallel_size"], "dp": plan["data_parallel_size"],
            "sp": plan["sequence_parallel"], "micro_batch": plan["micro_batch_size"],
            "grad_accum": plan["grad_accum_steps"],
            "recompute": str(config["trainer"]["activation_recompute"])}


def engine_key(plan: Mapping, config: Mapping) -> dict:
    """The key of an ``engine`` record: the model's and the layout's."""
    return {**model_key(config["model"], config["trainer"]["precision"]),
            **layout_key(plan, config)}


def engine_key_of(cfg, dims, grad_accum: int) -> dict:
    """:func:`engine_key` of a typed config at ``dims`` (the plan's side of the lookup)."""
    import dataclasses

    plan = {"engine": cfg.engine.name.value, "zero_stage": cfg.parallelism.zero_stage,
            "tensor_parallel_size": dims.tp, "pipeline_parallel_size": dims.pp,
            "virtual_pipeline_parallel_size": dims.vpp, "context_parallel_size": dims.cp,
            "expert_parallel_size": dims.ep, "data_parallel_size": dims.dp,
            "sequence_parallel": dims.sequence_parallel,
            "micro_batch_size": cfg.trainer.micro_batch_size, "grad_accum_steps": grad_accum}
    config = {"model": dataclasses.asdict(cfg.model),
              "trainer": {"precision": cfg.trainer.precision,
                          "activation_recompute": cfg.trainer.activation_recompute}}
    return engine_key(plan, config)


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation of (x, y) points at ``x``, extrapolated from the nearest
    two (one point: proportional to x)."""
    points = sorted(points)
    if len(points) == 1:
        px, py = points[0]
        return py * x / px if px else py
    i = 0
    while i < len(points) - 2 and x > points[i + 1][0]:
        i += 1
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    return y1 if x1 == x0 else max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def nearest_group_size(measured: set, ranks: int) -> int:
    """Of the ``measured`` group sizes, ``ranks`` itself or the nearest on a log scale (the
    larger of two as near)."""
    import math

    return min(measured, key=lambda m: (abs(math.log(max(m, 1) / max(ranks, 1))), -m))


def per_micro_batch(points: list[tuple[float, float]], micro_batch: int) -> float:
    """A pass figure at ``micro_batch`` from its measured (micro-batch, seconds) points: below
    the smallest measured micro-batch, in proportion to it; else :func:`interpolate`. (The line
    through two measured sizes, extended downwards, reached zero on a CPU where twice the
    micro-batch cost 2.5-3x: a layer predicted free at micro-batch 2.)"""
    smallest = min(points)
    if micro_batch < smallest[0]:
        return smallest[1] * micro_batch / smallest[0]
    return interpolate(points, micro_batch)


def _same(key: dict, want: dict) -> bool:
    return all(key.get(k) == v for k, v in want.items())


@dataclass(frozen=True)
class PassCost:
    """Seconds per micro-batch on one rank: a layer, the embedding, the output layer + loss."""

    layer: float
    embedding: float
    output: float


@dataclass(frozen=True)
class Calibration:
    """The figures of one profile, looked up by shape and size."""

    profile: MachineProfile

    @property
    def label(self) -> str:
        return f"calibrated: {self.profile.label}"

    @property
    def measured_label(self) -> str:
        """What a figure taken from this profile says of its source: "measured: <profile>"."""
        return f"measured: {self.profile.label}"

    def _section(self, name: str) -> list:
        section = self.profile.figures.get(name)
        return section if isinstance(section, list) else []

    def passes(self, model: dict, tp: int, micro_batch: int) -> Optional[PassCost]:
        """One rank's pass costs for ``model`` (a model key) at ``tp`` and ``micro_batch``."""
        rows = [r for r in self._section("passes")
                if _same(r.get("key", {}), {**model, "tp": tp})]
        if not rows:
            return None
        at = {name: per_micro_batch([(r["key"]["micro_batch"], r[f"{name}_s"]) for r in rows],
                                    micro_batch) for name in ("layer", "embedding", "output")}
        return PassCost(**at)

    def optimizer(self, numel: float) -> Optional[float]:
        rows = self._section("optimizer")
        if not rows:
            return None
        return interpolate([(r["key"]["numel"], r["seconds"]) for r in rows], numel)

    def collective(self, op: str, nbytes: float, ranks: int) -> Optional[float]:
        """Seconds of one ``op`` of ``nbytes`` per rank over a group of ``ranks``: from the
        records of that group size, else of the nearest one measured (on a log scale; a tie
        takes the larger group). A TP2 group on an 8-rank node is not priced at 8 ranks."""
        rows = [r for r in self._section("collectives") if r.get("key", {}).get("op") == op]
        if not rows or nbytes <= 0:
            return 0.0 if rows else None
        size = nearest_group_size({int(r["key"].get("ranks", 0)) for r in rows}, ranks)
        return interpolate([(r["key"]["bytes"], r["seconds"]) for r in rows
                            if int(r["key"].get("ranks", 0)) == size], nbytes)

    def launch(self) -> Optional[tuple[float, float]]:
        """(start-up, exit) seconds a run on this machine measured (launcher.probe
        --from-run), if any."""
        record = self.profile.figures.get("launch")
        if not isinstance(record, dict) or "startup_s" not in record:
            return None
        return float(record["startup_s"]), float(record.get("exit_s", 0.0))

    def engine(self, key: dict) -> list[dict]:
        """The engine records measured at exactly this model and layout (``key``), one per
        depth (the latest of each)."""
        want, by_depth = json.dumps(key, sort_keys=True), {}
        for r in self._section("engine"):
            if json.dumps(r.get("key"), sort_keys=True) == want:
                by_depth[r.get("layers")] = r
        return list(by_depth.values())

    def nearest_engine(self, key: dict) -> list[dict]:
        """The engine records of one other layout of the same model and engine (the latest
        measured; of the same ZeRO stage when there is one), every depth and batch split of
        it: their framework residual stands in for an unmeasured layout's. Empty when there
        are none."""
        same = {k: key[k] for k in key if k not in LAYOUT_ONLY and k != "zero_stage"}
        similar = [r for r in self._section("engine") if _same(r.get("key", {}), same)]
        similar = [r for r in similar if r["key"].get("zero_stage") == key["zero_stage"]] \
            or similar
        if not similar:
            return []
        layout = _without_split(similar[-1]["key"])
        return [r for r in similar if _without_split(r["key"]) == layout]


def _without_split(key: dict) -> dict:
    """An engine record's key less its batch split (micro-batch and accumulation)."""
    return {k: v for k, v in key.items() if k not in ("micro_batch", "grad_accum")}


LAYOUT_ONLY = ("tp", "pp", "vpp", "cp", "ep", "dp", "sp", "micro_batch", "grad_accum")
"""Keys of an engine record that another layout of the same job may differ in."""


def stage_costs(cal: Calibration, cost: PassCost, *, dims, layers: list, tokens: int,
                hidden: int, elem: int, recompute: str) -> list:
    """StageCost of every pipeline stage from measured passes and TP collectives."""
    from launcher.plan.step_time import StageCost

    tp = 0.0
    if dims.tp > 1:
        volume = tokens * hidden * elem
        passes = 3 if recompute == "full" else 2
        if dims.sequence_parallel:
            per = 2 * (cal.collective("all_gather", volume / dims.tp, dims.tp) or 0.0) \
                + 2 * (cal.collective("reduce_scatter", volume, dims.tp) or 0.0)
        else:
            per = 2 * (cal.collective("all_reduce", volume, dims.tp) or 0.0)
        tp = passes * per
    out = []
    for i, n in enumerate(layers):
        compute = n * cost.layer + (cost.embedding if i == 0 else 0.0) \
            + (cost.output if i == len(layers) - 1 else 0.0)
        out.append(StageCost(compute, compute / 3.0, n * tp, 0.0, 0.0))
    return out


def data_parallel_s(cal: Calibration, *, engine: str, zero_stage: int, dp: int, params: float,
                    grad_bytes: int, param_bytes: int, grad_accum: int) -> float:
    """The stage's gradient (and weight) traffic over its data-parallel group, not overlapped."""
    if dp <= 1 or params <= 0:
        return 0.0
    grads, weights = params * grad_bytes, params * param_bytes
    if zero_stage == 0:
        return cal.collective("all_reduce", grads, dp) or 0.0
    per_mb = engine == "deepspeed" and zero_stage >= 2
    reduce = (cal.collective("reduce_scatter", grads, dp) or 0.0) * (grad_accum if per_mb else 1)
    gathers = 2 * grad_accum if engine == "deepspeed" and zero_stage == 3 else 1
    return reduce + gathers * (cal.collective("all_gather", weights / dp, dp) or 0.0)


def find_calibration(cfg, device) -> tuple[Optional[Calibration], list[str]]:
    """(the calibration of this machine for ``cfg``'s cluster or None, notes on the stored
    profiles passed over). A cpu plan is for this machine's CPU; a GPU plan takes a profile of
    that GPU from any host, with this machine's library versions."""
    from launcher.plan.machine import cpu_info, library_versions
    from launcher.plan.profile import matching_profile, profile_dir

    c = cfg.cluster
    found, notes = matching_profile(
        profile_dir(cfg.plan.profile_dir), device=device.name,
        model=cpu_info().model if device.name == "cpu" else "",
        ranks=c.gpus_per_node * c.ranks_per_gpu, versions=library_versions())
    return (Calibration(found) if found is not None else None), notes
