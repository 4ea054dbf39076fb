"""The layouts a search tries: every TP, CP, PP (with the stage splits its layer count needs),
VPP, EP, ZeRO stage, engine, activation recompute and micro-batch size over the cluster's world.

Only world-size divisibility prunes here (the plan's own checks then drop the rest, see
:mod:`launcher.search.evaluate`); sequence parallelism is on whenever TP > 1 (it only saves
memory, at the same communication volume).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from launcher.config import Recompute, TrainwrightConfig
from launcher.core.problems import divisors
from launcher.shape.stages import StageSplit

RECOMPUTE = (Recompute.none, Recompute.selective, Recompute.full)
MAX_CONTEXT_PARALLEL = 32
"""Largest CP tried (ring attention beyond 32 ranks is not what Megatron-Core is tuned for)."""


@dataclass(frozen=True)
class Candidate:
    """One layout: the values the search sets (everything else is the composed config's)."""

    engine: str
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    split: StageSplit
    zero_stage: int
    micro_batch: int
    recompute: Recompute

    def overrides(self) -> list[str]:
        """The command-line overrides that select this candidate."""
        out = [f"engine={self.engine}", f"parallelism.tensor_parallel_size={self.tp}",
               f"parallelism.pipeline_parallel_size={self.pp}",
               f"parallelism.virtual_pipeline_parallel_size={self.vpp}",
               f"parallelism.context_parallel_size={self.cp}",
               f"parallelism.expert_parallel_size={self.ep}",
               f"parallelism.sequence_parallel={'true' if self.tp > 1 else 'false'}",
               f"parallelism.zero_stage={self.zero_stage}"]
        return out + self.split.overrides() + [
            f"trainer.micro_batch_size={self.micro_batch}",
            f"trainer.activation_recompute={self.recompute.value}"]


def stage_splits(num_layers: int, pp: int) -> list[StageSplit]:
    """The splits worth trying: even when it divides, the embedding and loss counted as layers
    when that divides, else the first and last stages given the remainder (an odd remainder:
    the last stage, which also holds the output layer and loss, the smaller share; so a prime
    layer count, DeepSeek-V3's 61, still pipelines)."""
    if pp == 1:
        return [StageSplit()]
    out = [StageSplit()] if num_layers % pp == 0 else []
    if (num_layers + 2) % pp == 0 and (num_layers + 2) // pp >= 2:
        out.append(StageSplit(embedding=True, loss=True))
    if num_layers % pp:
        middle = -(-num_layers // pp) if pp > 2 else 0
        ends = num_layers - (pp - 2) * middle
        if ends >= 2 and ends % 2 == 0 and pp >= 3:
            out.append(StageSplit(first=ends // 2, last=ends // 2))
        elif ends >= 2 and (ends % 2 or pp == 2):
            out.append(StageSplit(first=ends - ends // 2, last=ends // 2))
    return out


def virtual_sizes(num_layers: int, pp: int, split: StageSplit) -> list[int]:
    """VPP values whose chunks split every stage evenly (1 without pipelining)."""
    if pp == 1:
        return [1]
    if split.first:
        middle = (num_layers - split.first - split.last) // (pp - 2) if pp > 2 else 0
        per = math.gcd(split.first, split.last, middle)
    elif split.embedding:
        per = (num_layers + 2) // pp
        return [v for v in divisors(per) if per // v >= 2]
    else:
        per = num_layers // pp
    return divisors(per)


def engine_names(cfg: TrainwrightConfig) -> list[str]:
    """search.engines, or every registered engine."""
    from launcher.engines import REGISTRY

    return list(cfg.search.engines) or list(REGISTRY)


def _zero_stages(engine: str, pp: int, cp: int, ep: int, vpp: int) -> list[int]:
    if engine == "deepspeed":
        return [0, 1, 2, 3] if pp == cp == ep == vpp == 1 else []
    return [0, 1]


def _micro_batches(per_replica: int, limit: int) -> list[int]:
    return [b for b in divisors(per_replica) if b <= limit]


def candidates(cfg: TrainwrightConfig, world: int, global_batch: int) -> Iterator[Candidate]:
    """Every layout of ``world`` ranks for ``cfg``'s model and ``global_batch`` sequences."""
    m, c, s = cfg.model, cfg.cluster, cfg.search
    tp_limit = c.gpus_per_node * c.ranks_per_gpu * s.max_tensor_parallel_nodes
    experts = divisors(m.num_experts) if m.num_experts else [1]
    for tp in (t for t in divisors(world) if t <= tp_limit):
        for cp in (x for x in divisors(world // tp) if x <= MAX_CONTEXT_PARALLEL):
            for pp in (p for p in divisors(world // (tp * cp)) if p <= m.num_layers):
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                yield from _inner(cfg, tp, cp, pp, dp, experts, global_batch)


def _inner(cfg, tp, cp, pp, dp, experts, global_batch) -> Iterator[Candidate]:
    m, s = cfg.model, cfg.search
    for split in stage_splits(m.num_layers, pp):
        for vpp in virtual_sizes(m.num_layers, pp, split):
            for ep in (e for e in experts if (dp * cp) % e == 0):
                for engine in engine_names(cfg):
                    for zero in _zero_stages(engine, pp, cp, ep, vpp):
                        for mbs in _micro_batches(global_batch // dp, s.max_micro_batch_size):
                            for recompute in RECOMPUTE:
                                yield Candidate(engine, tp, pp, vpp, cp, ep, split, zero, mbs,
                                                recompute)
