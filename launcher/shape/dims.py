"""The parallel layout of one run as one frozen value: :class:`ParallelDims`.

``ParallelDims.build(parallelism, world)`` reads the parallel sizes of the config once and
derives every group size from them (data-parallel, expert-data-parallel, model-parallel, ...);
the rest of the plan reads the layout from it, never from the config again.
``ParallelDims.problems`` says why a layout cannot split its world, each problem with its fix.

The world is every training process: ``cluster.nodes x cluster.gpus_per_node`` GPUs, times
``cluster.ranks_per_gpu`` processes per GPU when several share one (development only).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import ClusterConfig, ParallelismConfig
from launcher.core.problems import Problem, divisors, fmt_values
from launcher.shape.stages import StageSplit, stage_layer_numbers, stage_layers

MODEL_PARALLEL_SIZES = (("tp", "tensor_parallel_size", "TP"), ("pp", "pipeline_parallel_size", "PP"),
                        ("vpp", "virtual_pipeline_parallel_size", "VPP"),
                        ("cp", "context_parallel_size", "CP"), ("ep", "expert_parallel_size", "EP"))
"""(short name in checkpoint layout records, ParallelismConfig field, label) of every
model-parallel size, the one table messages about layouts read."""


def cluster_world_size(cluster: ClusterConfig) -> int:
    """Training processes the cluster starts: nodes x gpus_per_node x ranks_per_gpu."""
    return cluster.nodes * cluster.gpus_per_node * cluster.ranks_per_gpu


def world_keys(cluster: ClusterConfig) -> tuple[str, ...]:
    """The config keys that set the world size (ranks_per_gpu only when it is in use)."""
    keys = ("cluster.nodes", "cluster.gpus_per_node")
    return keys + (("cluster.ranks_per_gpu",) if cluster.ranks_per_gpu > 1 else ())


def describe_world(cluster: ClusterConfig, world: int) -> str:
    """'world size 16 (cluster.nodes=2 x cluster.gpus_per_node=8)', for messages."""
    factors = [f"{key}={getattr(cluster, key.split('.')[1])}" for key in world_keys(cluster)]
    return f"world size {world} ({' x '.join(factors)})"


@dataclass(frozen=True)
class ParallelDims:
    """How the world's ranks split the model and the data; build with :meth:`build`."""

    tp: int
    """Tensor-parallel size: ranks that split every layer's matrices."""
    pp: int
    """Pipeline stages."""
    vpp: int
    """Model chunks per pipeline stage (interleaved schedule); 1 = not interleaved."""
    cp: int
    """Context-parallel size: ranks that split each sequence."""
    ep: int
    """Expert-parallel size: ranks that split the experts of each MoE layer."""
    dp: int
    """Data-parallel replicas of the dense model: world / (TP x PP x CP)."""
    edp: int
    """Expert-data-parallel replicas of each expert: world / (TP x EP x PP) (expert TP = TP)."""
    world: int
    """Training processes in all."""
    sequence_parallel: bool
    """Norm/dropout activations sharded along the sequence over the TP group."""
    split: StageSplit = StageSplit()
    """How the layers split over the pipeline stages (even, uneven first/last, ...)."""

    @classmethod
    def build(cls, parallelism: ParallelismConfig, world: int) -> "ParallelDims":
        """The layout of ``parallelism`` over ``world`` ranks. Sizes must be positive
        (validate.check_positive); a world the sizes do not divide is reported by
        :meth:`problems`, and its dp/edp are then rounded down."""
        p = parallelism
        tp, pp, cp, ep = (p.tensor_parallel_size, p.pipeline_parallel_size,
                          p.context_parallel_size, p.expert_parallel_size)
        if min(tp, pp, cp, ep, p.virtual_pipeline_parallel_size, world) < 1:
            raise ValueError(f"parallel sizes and world size must be positive: tp={tp}, pp={pp}, "
                             f"vpp={p.virtual_pipeline_parallel_size}, cp={cp}, ep={ep}, "
                             f"world={world}")
        return cls(tp=tp, pp=pp, vpp=p.virtual_pipeline_parallel_size, cp=cp, ep=ep,
                   dp=world // (tp * pp * cp), edp=world // (tp * ep * pp), world=world,
                   sequence_parallel=p.sequence_parallel, split=StageSplit.of(p))

    @property
    def model_parallel(self) -> int:
        """Ranks holding one replica of the dense model: TP x PP x CP."""
        return self.tp * self.pp * self.cp

    @property
    def expert_model_parallel(self) -> int:
        """Ranks holding one replica of every expert: TP x EP x PP."""
        return self.tp * self.ep * self.pp

    @property
    def tp_groups(self) -> int:
        return self.world // self.tp

    @property
    def dense_shards(self) -> int:
        """Ranks that share (ZeRO / distributed optimizer) one copy of the dense state: DP x CP."""
        return self.dp * self.cp

    @property
    def sequence_shards(self) -> int:
        """Ranks that split the activations outside the TP regions: TP with sequence parallel."""
        return self.tp if self.sequence_parallel else 1

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Transformer layers of every pipeline stage, first to last (see launcher.shape.stages)."""
        return stage_layers(num_layers, self.pp, self.split)

    def stage_layer_numbers(self, num_layers: int) -> tuple[tuple[int, ...], ...]:
        """Which transformer layers (from 0) every pipeline stage holds, its virtual chunks
        included (see launcher.shape.stages.stage_layer_numbers)."""
        return stage_layer_numbers(num_layers, self.pp, self.vpp, self.split)

    def layers_per_stage(self, num_layers: int) -> int:
        """Layers of the most loaded stage (num_layers / PP for an even split)."""
        return max(self.stage_layers(num_layers)) if self.split.uneven else num_layers // self.pp

    def bubble_fraction(self, grad_accum: int) -> float:
        """Idle share of the pipeline schedule: (PP - 1) / (VPP x micro-batches per step)."""
        return (self.pp - 1) / (self.vpp * grad_accum) if self.pp > 1 else 0.0

    def problems(self, cluster: ClusterConfig, moe: bool) -> list[Problem]:
        """Why this layout cannot run over its world (every reason, each with its fix);
        ``moe``: the model has experts, so TP x EP x PP must divide the world too."""
        world = describe_world(cluster, self.world)
        problems = [self._model_parallel_problem(world, world_keys(cluster)),
                    self._expert_problem(world) if moe else None,
                    self._sequence_parallel_problem(), self._virtual_pipeline_problem(),
                    self._tensor_parallel_node_problem(cluster)]
        return [p for p in problems if p is not None]

    def _tensor_parallel_node_problem(self, cluster: ClusterConfig) -> Problem | None:
        """On GPUs a tensor-parallel group fills whole nodes or divides one: TP=8 on nodes of 3
        GPUs would straddle nodes unevenly. (TP=16 on 8-GPU nodes is allowed; the plan prices
        its all-reduces over the network.) CPU clusters (tests of multi-node layouts) are
        exempt."""
        per_node = cluster.gpus_per_node * cluster.ranks_per_gpu
        if cluster.gpu.lower() == "cpu" or per_node % self.tp == 0 or self.tp % per_node == 0:
            return None
        return Problem(
            ("parallelism.tensor_parallel_size", "cluster.gpus_per_node"),
            f"tensor_parallel_size={self.tp} and cluster.gpus_per_node={per_node} do not divide "
            "one another: tensor-parallel groups would straddle nodes unevenly; use "
            f"tensor_parallel_size from {fmt_values(divisors(per_node))} (or a multiple of "
            f"{per_node}), or nodes of a multiple of {self.tp} GPUs")

    def _model_parallel_problem(self, world: str, keys: tuple[str, ...]) -> Problem | None:
        mp = self.model_parallel
        if self.world % mp == 0:
            return None
        return Problem(
            keys + ("parallelism.tensor_parallel_size", "parallelism.pipeline_parallel_size",
                    "parallelism.context_parallel_size"),
            f"{world} is not a multiple of TP x PP x CP = {mp} (tensor_parallel_size={self.tp}, "
            f"pipeline_parallel_size={self.pp}, context_parallel_size={self.cp}); use a world "
            f"size that is a multiple of {mp}, or TP x PP x CP from {fmt_values(divisors(self.world))}")

    def _expert_problem(self, world: str) -> Problem | None:
        emp = self.expert_model_parallel
        if self.world % emp == 0:
            return None
        return Problem(
            ("parallelism.expert_parallel_size", "parallelism.tensor_parallel_size"),
            f"{world} is not a multiple of TP x EP x PP = {emp} (tensor_parallel_size={self.tp}, "
            f"expert_parallel_size={self.ep}, pipeline_parallel_size={self.pp}); choose EP so "
            f"that TP x EP x PP divides {self.world}")

    def _sequence_parallel_problem(self) -> Problem | None:
        if not self.sequence_parallel or self.tp > 1:
            return None
        return Problem(
            ("parallelism.sequence_parallel", "parallelism.tensor_parallel_size"),
            "parallelism.sequence_parallel=true needs tensor_parallel_size > 1 (it shards along "
            "the TP group); set parallelism.sequence_parallel=false or raise tensor_parallel_size")

    def _virtual_pipeline_problem(self) -> Problem | None:
        if self.vpp == 1 or self.pp > 1:
            return None
        return Problem(
            ("parallelism.virtual_pipeline_parallel_size", "parallelism.pipeline_parallel_size"),
            f"parallelism.virtual_pipeline_parallel_size={self.vpp} needs "
            "pipeline_parallel_size > 1; set virtual_pipeline_parallel_size=1")
