"""The pre-flight plan: a pure function of (config, world size) that checks and derives everything.

``python -m launcher.plan [overrides]`` (:mod:`launcher.plan.__main__`) prints it as a table, or
with ``plan.format=json`` as one JSON object on stdout (:meth:`Plan.to_dict`). Every validation
problem is collected and printed with its fix; the exit code is then 2. No torch.distributed, no
GPU, no model is built. A Plan is a few typed parts: where it runs (:class:`Machines`), the model
as built, the layout (ParallelDims), the batch, parameter counts, memory, compute and what
interruptions will cost (:mod:`launcher.plan.goodput`).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from launcher.config import (AttentionBackend, DataFormat, Precision, TrainwrightConfig,
                             loss_kernel)
from launcher.engines import spec
from launcher.plan import fp8
from launcher.plan.engine_choice import engine_notes
from launcher.plan.flops import train_flops_per_token
from launcher.core.objectstore import is_remote
from launcher.plan.goodput import (CPU_STARTUP_S, EXIT_S, STARTUP_S, GoodputPlan,
                                   LaunchCost, plan_goodput)
from launcher.plan.kubernetes import kubernetes_warnings
from launcher.plan.cpu_rates import plan_device
from launcher.plan.hardware import Device
from launcher.plan.memory import (ActivationSettings, in_flight_microbatches,
                                  stage_activation_bytes, state_bytes_per_param)
from launcher.plan.params import (ParamCounts, StageParams, count_parameters, stage_params,
                                  stage_views)
from launcher.plan.precision import PrecisionChoice, with_precision
from launcher.plan.calibrated import Calibration, find_calibration
from launcher.plan.data_check import chat_token_shares
from launcher.plan.resilience import (evaluations, planned_eval_s, planned_first_phase_s,
                                      planned_tasks_s, resilience_problems, resilience_warnings)
from launcher.plan.step_time import StepTime
from launcher.plan.timing import peak_flops, predict_step, unprobed
from launcher.plan.validate import (Problem, check_batch, check_interleaving, check_positive,
                                    check_static, check_values, schedule_warnings)
from launcher.shape import Batch
from launcher.shape.dims import ParallelDims, cluster_world_size
from launcher.shape.model import ResolvedModel


class PlanError(Exception):
    """The config cannot be trained as given; ``problems`` says every reason and its fix."""

    def __init__(self, problems: list[Problem], plan: "Plan | None" = None):
        self.problems = problems
        self.plan = plan  # the derived plan, when only its memory or resilience checks failed
        super().__init__("\n".join(f"- {p}" for p in problems))


@dataclass(frozen=True)
class Machines:
    """Where the ranks run."""

    nodes: int
    gpus_per_node: int
    ranks_per_gpu: int
    """Training processes sharing each GPU (cluster.ranks_per_gpu)."""
    gpu: str
    """The accelerator model (a key of launcher.plan.hardware.DEVICES)."""
    gpu_memory_bytes: int
    peak_tflops_per_gpu: float
    """Dense peak at the training precision (TFLOP/s)."""


@dataclass(frozen=True)
class ParamSummary:
    """Parameter counts (one copy of every weight) and the most loaded GPU's share."""

    total: int
    total_unpadded: int
    """Without the vocabulary padding (the published figure)."""
    active_per_token: int
    """What a token passes through (top-k experts only)."""
    by_component: dict
    """embedding, attention, mlp, norms, output_layer."""
    vocab_padding: int
    """Parameters of the padding rows of the embedding (and output layer)."""
    per_gpu: int
    """Held by one GPU of the most loaded pipeline stage."""


@dataclass(frozen=True)
class MemoryPerGPU:
    """Bytes on the most loaded GPU."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    total: int
    cpu_offload: int
    """Optimizer state / parameters kept in host memory instead."""
    stage: str
    """The most loaded pipeline stage: first, middle (the second), last, all (PP=1)."""


@dataclass(frozen=True)
class Memory:
    """Memory per GPU, and the training state across the world."""

    per_gpu: MemoryPerGPU
    training_state_bytes: int
    """Weights, gradients and optimizer state of one unsharded copy."""
    redundant_state_bytes: int
    """Of the state the GPUs hold, the bytes held more than once."""
    activation_recompute: str
    flash_attention: bool
    """Attention scores are never stored (the activation count assumes it)."""


@dataclass(frozen=True)
class Compute:
    """FLOPs, step time and throughput."""

    flops_per_token: float
    flops_per_token_causal: float
    """Causal attention counted half (Megatron-LM's and NeMo's logs)."""
    flops_per_step: float
    step_time_s: float
    parts: dict
    """Seconds per cause of the step-time model (step_time.PARTS; under the flat plan.mfu
    assumption the step time is the flat one's, not their sum)."""
    dominant_cost: str
    """The largest cost besides compute ("compute" if none matters)."""
    mfu: float
    """Model FLOPs utilisation of the whole step."""
    mfu_causal: float
    mfu_while_computing: float
    """MFU of the compute alone (the flat assumption's value under plan.mfu)."""
    bubble_fraction: float
    """Idle share of the pipeline schedule: (PP - 1) / (VPP x accumulation)."""
    tokens_per_s: float
    time_to_train_days: float
    fp8_layers: str
    """What runs FP8 GEMMs (trainer.precision=fp8), "" otherwise."""


@dataclass(frozen=True)
class Plan:
    """Everything derived from a config, in parts; :meth:`to_dict` is plan.json."""

    engine: str
    zero_stage: int
    machines: Machines
    model: ResolvedModel
    """The model as built at the plan's tensor-parallel size."""
    dims: ParallelDims
    batch: Batch
    params: ParamSummary
    memory: Memory
    compute: Compute
    engine_notes: tuple = ()
    """Why the chosen engine runs this layout, what the others would not."""
    warnings: tuple = ()
    """Worth a word, not a refusal (e.g. warmup longer than the run)."""
    goodput: Optional[GoodputPlan] = None
    """What interruptions will cost and the best save interval (launcher.plan.goodput)."""
    precision: str = ""
    """The precision the run trains in (trainer.precision=auto resolved: launcher/plan/
    precision.py)."""
    precision_reason: str = ""
    """Why that precision (auto: the device's bf16 speed; else "as set")."""
    first_phase_timeout_s: float = 0.0
    """Seconds start-up and each first phase may take before the watch calls it a hang
    (resilience.first_phase_timeout_s, or derived from this plan)."""
    sources: dict = field(default_factory=dict)
    """Where each figure comes from: "measured: <profile>, <date>", the catalogue, an
    assumption (what: source)."""
    downstream: dict = field(default_factory=dict)
    """Downstream tasks (eval.tasks): {"rows": per evaluation, "seconds": one evaluation,
    "evaluations": in the run}; empty without tasks."""
    chat_tokens: dict = field(default_factory=dict)
    """data.format=chat: {"real": share of a row's tokens that are conversation (the rest is
    padding), "trained": share that are targets} from the shards' manifests; empty otherwise
    (or without manifests)."""

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Transformer layers of every pipeline stage, first to last."""
        return self.dims.stage_layers(self.model.layers)

    def to_dict(self) -> dict:
        """plan.json: flat keys (the names scripts read: README) plus ``dims``."""
        d, b, m, h = self.dims, self.batch, self.memory, self.machines
        return {
            "world_size": d.world, "nodes": h.nodes, "gpus_per_node": h.gpus_per_node,
            "ranks_per_gpu": h.ranks_per_gpu, "gpu": h.gpu, "engine": self.engine,
            "dims": asdict(d), "tensor_parallel_size": d.tp, "pipeline_parallel_size": d.pp,
            "virtual_pipeline_parallel_size": d.vpp, "context_parallel_size": d.cp,
            "expert_parallel_size": d.ep, "sequence_parallel": d.sequence_parallel,
            "zero_stage": self.zero_stage, "data_parallel_size": d.dp,
            "expert_data_parallel_size": d.edp, "model_parallel_size": d.model_parallel,
            "tensor_parallel_groups": d.tp_groups,
            "layers_per_stage": d.layers_per_stage(self.model.layers),
            "stage_layers": list(self.stage_layers), **_batch_keys(b),
            **_param_keys(self.params, self.model), "memory_per_gpu": asdict(m.per_gpu),
            "gpu_memory_bytes": h.gpu_memory_bytes, "training_state_bytes": m.training_state_bytes,
            "redundant_state_bytes": m.redundant_state_bytes,
            "activation_recompute": m.activation_recompute, "flash_attention": m.flash_attention,
            "peak_tflops_per_gpu": h.peak_tflops_per_gpu, **_compute_keys(self.compute),
            "engine_notes": list(self.engine_notes), "warnings": list(self.warnings),
            "goodput": self.goodput.to_dict() if self.goodput else None,
            "precision": self.precision, "precision_reason": self.precision_reason,
            "first_phase_timeout_s": self.first_phase_timeout_s, "sources": dict(self.sources),
            "downstream": dict(self.downstream), "chat_tokens": dict(self.chat_tokens)}


def _batch_keys(b: Batch) -> dict:
    return {"micro_batch_size": b.micro_batch_size, "micro_batch_tokens": b.micro_batch_tokens,
            "grad_accum_steps": b.grad_accum_steps, "global_batch_size": b.global_batch_size,
            "global_batch_tokens": b.global_batch_tokens, "seq_length": b.seq_length,
            "train_steps": b.train_steps, "train_tokens": b.train_tokens}


def _param_keys(p: ParamSummary, model: ResolvedModel) -> dict:
    return {"params_total": p.total, "params_total_unpadded": p.total_unpadded,
            "params_active_per_token": p.active_per_token, "params_by_component": p.by_component,
            "vocab_size": model.vocab, "padded_vocab_size": model.padded_vocab,
            "vocab_padding_params": p.vocab_padding, "params_per_gpu": p.per_gpu}


def _compute_keys(c: Compute) -> dict:
    return {"flops_per_token": c.flops_per_token,
            "flops_per_token_causal": c.flops_per_token_causal,
            "flops_per_step": c.flops_per_step, "step_time_s": c.step_time_s,
            "step_time_parts": c.parts, "dominant_cost": c.dominant_cost, "mfu": c.mfu,
            "mfu_causal": c.mfu_causal, "assumed_mfu": c.mfu_while_computing,
            "pipeline_bubble_fraction": c.bubble_fraction, "tokens_per_s": c.tokens_per_s,
            "time_to_train_days": c.time_to_train_days, "fp8_layers": c.fp8_layers}


def _uses_flash(cfg: TrainwrightConfig, device: Device) -> bool:
    backend = cfg.trainer.attention_backend
    if backend == AttentionBackend.auto:  # local layers (OLMo 2, Gemma 3): unfused on a GPU too
        return device.name != "cpu" and not ResolvedModel.of(cfg.model).local_layers
    return backend == AttentionBackend.flash


def _stage_views(dims: ParallelDims, d: ResolvedModel) -> list[tuple[str, int, list[int]]]:
    """(name, index, layer numbers) of the stages that can be the most loaded
    (:func:`launcher.plan.params.stage_views`): the first (most micro-batches in flight, the
    embedding), the second (the most in flight of the middle stages, which hold equal layers;
    with dense first layers, each middle stage of another mix of layers too) and the last
    (the output layer and logits)."""
    numbers = dims.stage_layer_numbers(d.layers)
    if dims.pp == 1:
        return [("all", 0, list(numbers[0]))]
    views = stage_views(d, dims)
    names = {0: "first", views[1] if dims.pp > 2 else -1: "middle", dims.pp - 1: "last"}
    return [(names.get(i, _ordinal(i + 1)), i, list(numbers[i])) for i in views]


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _memory(cfg: TrainwrightConfig, dims: ParallelDims, batch: Batch, flash: bool,
            gpu_kernels: bool) -> MemoryPerGPU:
    """Memory per GPU of the most loaded stage; ``gpu_kernels``: the target is a GPU, where the
    model uses fused kernels."""
    return max(stage_memory(cfg, dims, batch, flash, gpu_kernels), key=lambda m: m.total)


def stage_memory(cfg: TrainwrightConfig, dims: ParallelDims, batch: Batch, flash: bool,
                 gpu_kernels: bool) -> list[MemoryPerGPU]:
    """Memory per GPU of each stage that can be the most loaded (:func:`_stage_views`)."""
    m, p, e = cfg.model, cfg.parallelism, cfg.engine
    d = ResolvedModel.of(m, dims.tp)
    state = dict(precision=cfg.trainer.precision, engine=e.name, zero_stage=p.zero_stage,
                 grad_fp32=e.grad_reduce_in_fp32, offload_optimizer=p.offload_optimizer,
                 offload_params=p.offload_params)
    gathered = spec(e.name).gathered_layers(p.zero_stage)
    dense_b = state_bytes_per_param(**state, shards=dims.dense_shards)
    expert_b = state_bytes_per_param(**state, shards=dims.edp)
    acts = ActivationSettings(
        micro_batch=cfg.trainer.micro_batch_size, seq_local=m.seq_length // dims.cp, tp=dims.tp,
        sequence_parallel=dims.sequence_parallel, recompute=cfg.trainer.activation_recompute,
        flash=flash, elem_bytes=4 if cfg.trainer.precision == Precision.fp32 else 2,  # fp8: bf16
        hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
        fused_glu=gpu_kernels,
        # a GPU target is planned with TE; a process without it replans (runnable_attention)
        logits_fp32=loss_kernel(cfg.trainer.cross_entropy_fusion, precision=cfg.trainer.precision,
                                gpu=gpu_kernels, te=True) != "te")
    stages = []
    for name, index, numbers in _stage_views(dims, d):
        first, last = index == 0, index == dims.pp - 1
        sp = stage_params(m, dims, first, last, stage=index, te=gpu_kernels)
        part = {k: getattr(dense_b, k) * sp.dense + getattr(expert_b, k) * sp.expert
                for k in ("weights", "grads", "optimizer", "cpu")}
        part["weights"] += gathered * sp.largest_layer * acts.elem_bytes  # ZeRO-3 gathers
        part["weights"] += fp8.extra_state_bytes(cfg, d, dims, numbers)
        activations = stage_activation_bytes(
            d, acts, layers=len(numbers),
            in_flight=in_flight_microbatches(dims, batch.grad_accum_steps, index),
            first=first, last=last, kinds=d.layer_kinds(numbers))
        total = part["weights"] + part["grads"] + part["optimizer"] + activations
        stages.append(MemoryPerGPU(int(part["weights"]), int(part["grads"]),
                                   int(part["optimizer"]), int(activations), int(total),
                                   int(part["cpu"]), name))
    return stages


def _state_totals(cfg: TrainwrightConfig, counts: ParamCounts, mem: MemoryPerGPU,
                  world: int) -> tuple[int, int]:
    """(training state of one unsharded copy, bytes of it held redundantly across the world)."""
    unsharded = state_bytes_per_param(
        precision=cfg.trainer.precision, engine=cfg.engine.name, zero_stage=0,
        grad_fp32=cfg.engine.grad_reduce_in_fp32, offload_optimizer=False,
        offload_params=False, shards=1)
    one_copy = int(counts.total * (unsharded.weights + unsharded.grads + unsharded.optimizer))
    # Every GPU holds about what the most loaded one holds (first/last stages differ little).
    held = (mem.weights + mem.grads + mem.optimizer + mem.cpu_offload) * world
    return one_copy, max(0, held - one_copy)


def compute_plan(cfg: TrainwrightConfig, world_size: int | None = None,
                 measure_precision: bool = False) -> Plan:
    """Check ``cfg`` and derive the plan; raise PlanError listing every problem. With
    ``measure_precision`` a cpu run times the plan's CPU check (a short matmul in both
    precisions and a streaming add: launcher/plan/precision.py) when no stored profile holds
    it; without, an unstored check leaves the CPU's flags to choose the precision and the
    catalogue's rates to price it (launcher/plan/cpu_rates.py)."""
    c = cfg.cluster
    device, choice, gpu_problems = None, None, []
    try:
        device, choice = plan_device(cfg, measure=measure_precision)
    except KeyError as exc:
        gpu_problems.append(Problem(("cluster.gpu",), str(exc.args[0])))
    if device is not None:
        cfg = with_precision(cfg, choice.precision)
    dims, problems = _layout(cfg, world_size or cluster_world_size(c))
    problems += gpu_problems
    if dims is not None:
        problems += fp8.problems(cfg, dims, device)
    batch = None
    if dims is not None and dims.dp >= 1 and dims.world % dims.model_parallel == 0:
        batch_problems = check_batch(cfg, dims.dp)  # independent of the model-shape problems
        problems += batch_problems
        batch = None if batch_problems else Batch.of(cfg.trainer, cfg.model.seq_length, dims.dp)
    if problems:
        raise PlanError(problems)
    calibration, _ = find_calibration(cfg, device)
    return _derive(cfg, dims, device, batch, choice, calibration)


def _layout(cfg: TrainwrightConfig, world: int) -> tuple[ParallelDims | None, list[Problem]]:
    """The run's ParallelDims, built once the sizes are positive, and every static problem."""
    problems = check_values(cfg)
    positive = check_positive(cfg)
    if positive:  # the layout and divisibility checks would divide by zero
        return None, problems + positive
    dims = ParallelDims.build(cfg.parallelism, world)
    return dims, problems + check_static(cfg, dims)


def _step(cfg: TrainwrightConfig, dims: ParallelDims, device: Device, batch: Batch,
          flash: bool, most: StageParams, flops_step: float,
          calibration: Optional[Calibration] = None) -> tuple[StepTime, float, float]:
    """(step-time breakdown, step seconds, MFU while computing): the step-time model, or with
    plan.mfu > 0 the flat assumption (that MFU while computing, the bubble on top)."""
    gpus = dims.world / cfg.cluster.ranks_per_gpu  # ranks sharing a GPU share its FLOP/s
    peak = peak_flops(cfg, device)
    model = predict_step(cfg, dims, batch.grad_accum_steps, device, flash, most.dense, most.expert,
                         flops_step / gpus, calibration)
    if cfg.plan.mfu > 0:
        bubble = dims.bubble_fraction(batch.grad_accum_steps)
        flat = flops_step / (gpus * peak * cfg.plan.mfu) * (1 + bubble)
        return model, flat, cfg.plan.mfu
    return model, model.total, model.compute_only_mfu


def _derive(cfg: TrainwrightConfig, dims: ParallelDims, device: Device, batch: Batch,
            choice: PrecisionChoice, calibration: Optional[Calibration] = None) -> Plan:
    model = ResolvedModel.of(cfg.model, dims.tp)
    flash = _uses_flash(cfg, device)
    per_gpu = _memory(cfg, dims, batch, flash, gpu_kernels=device.name != "cpu")
    counts = count_parameters(cfg.model, dims.tp)
    one_copy, redundant = _state_totals(cfg, counts, per_gpu, dims.world)
    most = _most_loaded_stage(cfg.model, dims, te=device.name != "cpu")
    machines = Machines(cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.ranks_per_gpu,
                        device.name, device.memory_bytes, peak_flops(cfg, device) / 1e12)
    compute, measured = _compute(cfg, dims, device, batch, flash, most, model, calibration)
    eval_s = planned_eval_s(compute.step_time_s, cfg.trainer.eval_iters, batch.grad_accum_steps)
    ev = cfg.eval
    tasks_s = planned_tasks_s(compute.step_time_s, (ev.tokens or ev.rows * cfg.model.seq_length)
                              if ev.tasks else 0, batch.micro_batch_tokens * dims.dp,
                              batch.grad_accum_steps)
    goodput = _goodput(cfg, counts, per_gpu, batch, compute, eval_s,
                       launch_cost(device, calibration), tasks_s)
    if not cfg.eval.asynchronous:  # eval jobs do not stall the run's heartbeat
        eval_s = max(eval_s, tasks_s)  # the longest evaluation, for the timeouts
    plan = Plan(
        engine=cfg.engine.name.value, zero_stage=cfg.parallelism.zero_stage, machines=machines,
        model=model, dims=dims, batch=batch,
        params=ParamSummary(counts.total, counts.total_unpadded, counts.active_per_token,
                            {k: getattr(counts, k) for k in COMPONENTS}, counts.vocab_padding,
                            most.total),
        memory=Memory(per_gpu, one_copy, redundant, cfg.trainer.activation_recompute.value, flash),
        compute=compute, engine_notes=tuple(engine_notes(cfg)),
        warnings=tuple([choice.warning] * bool(choice.warning)
                       + schedule_warnings(cfg, batch.train_steps)
                       + [str(x) for x in check_interleaving(dims, batch.grad_accum_steps)]
                       + resilience_warnings(cfg, step_time_s=compute.step_time_s,
                                             goodput=goodput)
                       + kubernetes_warnings(cfg.cluster, cfg.logger)),
        goodput=goodput, precision=choice.precision.value, precision_reason=choice.reason,
        first_phase_timeout_s=planned_first_phase_s(
            cfg.resilience, startup_s=goodput.startup_s, load_s=goodput.load_s,
            step_s=compute.step_time_s, save_s=goodput.save_s, eval_s=eval_s),
        sources=_sources(cfg, calibration if measured else None, goodput, choice,
                         unprobed(cfg, dims), device.rates),
        downstream=_downstream(cfg, batch, tasks_s),
        chat_tokens=(chat_token_shares(cfg.data.prefixes) if cfg.data.format == DataFormat.chat
                     else {}))
    problems = _fit_problems(plan) + resilience_problems(
        cfg, step_time_s=compute.step_time_s, eval_s=eval_s, goodput=goodput)
    if problems:
        raise PlanError(problems, plan)
    return plan


def _goodput(cfg: TrainwrightConfig, counts: ParamCounts, per_gpu: MemoryPerGPU, batch: Batch,
             compute: Compute, eval_s: float, launch: LaunchCost,
             tasks_s: float = 0.0) -> GoodputPlan:
    """Planned save time, expected goodput (start-up, exit and evaluations counted) and the
    best save interval; ``eval_s``: one validation pass, ``tasks_s``: one evaluation of the
    downstream tasks."""
    c, t = cfg.cluster, cfg.trainer
    unsharded = state_bytes_per_param(
        precision=t.precision, engine=cfg.engine.name, zero_stage=0,
        grad_fp32=cfg.engine.grad_reduce_in_fp32, offload_optimizer=False,
        offload_params=False, shards=1)
    saved = int(counts.total * (unsharded.weights + unsharded.optimizer))
    return plan_goodput(
        checkpoint_bytes=saved, bytes_per_gpu=per_gpu.weights + per_gpu.optimizer,
        nodes=c.nodes, gbps_per_node=c.checkpoint_gbps_per_node,
        node_mtbf_hours=c.mtbf_hours, async_save=t.async_save,
        step_time_s=compute.step_time_s, save_interval=t.save_interval,
        train_steps=batch.train_steps, launch=launch,
        store_gbps_per_node=c.store_gbps_per_node if is_remote(t.checkpoint_uri) else 0.0,
        eval_s=eval_s * (batch.train_steps // t.eval_interval if t.eval_interval else 0)
        + tasks_s * (evaluations(batch.train_steps, cfg.eval.interval, cfg.eval.at_end)
                     if cfg.eval.tasks and not cfg.eval.asynchronous else 0))


def _downstream(cfg: TrainwrightConfig, batch: Batch, tasks_s: float) -> dict:
    ev = cfg.eval
    if not ev.tasks:
        return {}
    if ev.asynchronous:  # one eval job per checkpoint, outside the run's time
        saves = batch.train_steps // t_save if (t_save := cfg.trainer.save_interval) else 0
        return {"rows": ev.rows, "tokens": ev.tokens, "seconds": tasks_s, "evaluations": 0,
                "jobs": saves + (1 if not t_save or batch.train_steps % t_save else 0)}
    return {"rows": ev.rows, "tokens": ev.tokens, "seconds": tasks_s,
            "evaluations": evaluations(batch.train_steps, ev.interval, ev.at_end)}


def _sources(cfg: TrainwrightConfig, calibration: Optional[Calibration], goodput: GoodputPlan,
             choice: PrecisionChoice, unmeasurable: str = "", rates: str = "") -> dict:
    """Where each of the plan's figures comes from (measured, catalogue or assumed);
    ``unmeasurable``: why no probe can measure this layout's step (timing.unprobed);
    ``rates``: where the device's rates were timed when not the catalogue's (Device.rates)."""
    model = f"rates of {rates}" if rates \
        else f"catalogue ({cfg.cluster.gpu} in launcher/plan/hardware.py)"
    step = calibration.measured_label if calibration is not None \
        else f"{model}, not calibrated: " \
             + (unmeasurable or "python -m launcher.probe measures this machine")
    return {"calibration": calibration.label if calibration is not None
            else "catalogue, not calibrated",
            "step time": step,
            "links between nodes": "catalogue (the probe measures one node's ranks)"
            if cfg.cluster.nodes > 1 else "none: one node",
            "start-up and exit": goodput.launch_source,
            "checkpoint save/load": f"assumed: cluster.checkpoint_gbps_per_node="
                                    f"{cfg.cluster.checkpoint_gbps_per_node:g} GB/s" + (
                f", object store cluster.store_gbps_per_node="
                f"{cfg.cluster.store_gbps_per_node:g} GB/s (upload in the background, a "
                "resume downloads the whole checkpoint on every node)"
                if is_remote(cfg.trainer.checkpoint_uri) else ""),
            "interruptions": f"assumed: cluster.mtbf_hours={cfg.cluster.mtbf_hours:g} per node",
            "memory": "model of the built tensors (docs/plan.md), device memory from the "
                      "catalogue",
            "precision": choice.reason}


def launch_cost(device: Device, calibration: Optional[Calibration] = None) -> LaunchCost:
    """One launch's start-up and exit: a run's on this machine (the profile's), else assumed per
    kind of device (launcher/plan/goodput.py)."""
    measured = calibration.launch() if calibration is not None else None
    if measured is not None:
        return LaunchCost(*measured, calibration.measured_label)
    return LaunchCost(CPU_STARTUP_S if device.name == "cpu" else STARTUP_S, EXIT_S)


COMPONENTS = ("embedding", "attention", "mlp", "norms", "output_layer")
"""The parameter counts by component the plan reports."""


def _most_loaded_stage(model, dims: ParallelDims, te: bool = True) -> StageParams:
    """Parameters of one GPU of the pipeline stage that holds the most (``te``: built with
    Transformer Engine's layer spec, as on GPUs)."""
    d = ResolvedModel.of(model, dims.tp)
    return max((stage_params(model, dims, first=i == 0, last=i == dims.pp - 1, stage=i, te=te)
                for i in stage_views(d, dims)), key=lambda s: s.total)


def _compute(cfg: TrainwrightConfig, dims: ParallelDims, device: Device, batch: Batch,
             flash: bool, most: StageParams, model: ResolvedModel,
             calibration: Optional[Calibration]) -> tuple[Compute, bool]:
    """(FLOPs (full and causal), the step time and what follows from it; whether the step
    time was composed from measured parts)."""
    flops_token = train_flops_per_token(model)
    causal_token = train_flops_per_token(model, causal=True)  # Megatron-LM's count
    flops_step = flops_token * batch.global_batch_tokens
    breakdown, step_time, computing_mfu = _step(cfg, dims, device, batch, flash, most, flops_step,
                                                calibration)
    gpus = dims.world / cfg.cluster.ranks_per_gpu  # ranks sharing a GPU share its FLOP/s
    mfu = flops_step / (gpus * peak_flops(cfg, device) * step_time)
    return Compute(
        flops_per_token=flops_token, flops_per_token_causal=causal_token, flops_per_step=flops_step,
        step_time_s=step_time, parts=breakdown.parts(), dominant_cost=breakdown.dominant, mfu=mfu,
        mfu_causal=mfu * causal_token / flops_token, mfu_while_computing=computing_mfu,
        bubble_fraction=dims.bubble_fraction(batch.grad_accum_steps),
        tokens_per_s=batch.global_batch_tokens / step_time,
        time_to_train_days=batch.train_steps * step_time / 86400,
        fp8_layers=fp8.describe(cfg)), breakdown.measured and not cfg.plan.mfu


def _fit_problems(plan: Plan) -> list[Problem]:
    """A plan whose ranks on one GPU (ranks_per_gpu of them) need more than its memory."""
    cap, n = plan.machines.gpu_memory_bytes, plan.machines.ranks_per_gpu
    if not cap or n * plan.memory.per_gpu.total <= cap:
        return []
    keys = ("trainer.activation_recompute", "trainer.micro_batch_size")
    if n > 1:
        keys = ("cluster.ranks_per_gpu",) + keys
    return [Problem(keys, _overflow_message(plan))]


def _stage_note(stage: str) -> str:
    return "" if stage == "all" else f"; {stage} pipeline stage"


def _memory_fixes(plan: Plan) -> list[str]:
    fixes, n = [], plan.machines.ranks_per_gpu
    if n > 1:
        fixes.append(f"fewer cluster.ranks_per_gpu (now {n})")
    if plan.memory.activation_recompute != "full":
        fixes.append("trainer.activation_recompute=full")
    if plan.batch.micro_batch_size > 1:
        fixes.append(f"a smaller trainer.micro_batch_size (now {plan.batch.micro_batch_size})")
    if plan.dims.tp > 1 and not plan.dims.sequence_parallel:
        fixes.append("parallelism.sequence_parallel=true")
    fixes.append("more sharding (parallelism.tensor_parallel_size, pipeline_parallel_size, "
                 "zero_stage)")
    if n > 1:
        fixes.append("a smaller model (model.num_layers, hidden_size, seq_length)")
    return fixes


def _overflow_message(plan: Plan) -> str:
    gib, mem, n = 2 ** 30, plan.memory.per_gpu, plan.machines.ranks_per_gpu
    parts = (f"weights {mem.weights / gib:.1f}, grads {mem.grads / gib:.1f}, optimizer "
             f"{mem.optimizer / gib:.1f}, activations {mem.activations / gib:.1f}"
             f"{_stage_note(mem.stage)}")
    fixes = "; try " + ", or ".join(_memory_fixes(plan))
    cap, gpu = plan.machines.gpu_memory_bytes / gib, plan.machines.gpu
    if n == 1:
        return (f"memory per GPU {mem.total / gib:.1f} GiB ({parts}) exceeds the {gpu}'s "
                f"{cap:.1f} GiB" + fixes)
    return (f"cluster.ranks_per_gpu={n} ranks share each {gpu}: {n} x "
            f"{mem.total / gib:.1f} GiB per rank ({parts}) = {n * mem.total / gib:.1f} GiB "
            f"exceeds its {cap:.1f} GiB" + fixes)


def print_problems(error: PlanError) -> None:
    """Every problem of a refused plan, with its fix, on stderr."""
    print(f"plan: {len(error.problems)} problem(s):\n{error}", file=sys.stderr)


def print_warnings(plan: Plan) -> None:
    """The plan's warnings on stderr (they do not stop anything)."""
    for warning in plan.warnings:
        print(f"plan: warning: {warning}", file=sys.stderr)


def plan_or_exit(cfg: TrainwrightConfig, world_size: int | None = None) -> Plan:
    """compute_plan for entry points (the precision measured where it must be): on problems
    print them and exit with code 2."""
    from launcher.core.exits import CONFIG_ERROR_EXIT

    try:
        plan = compute_plan(cfg, world_size, measure_precision=True)
    except PlanError as exc:
        print_problems(exc)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    print_warnings(plan)
    return plan


@dataclass(frozen=True)
class LayoutEstimate:
    """The plan's checks, memory and step time of one layout, without the rest of the plan
    (what :mod:`launcher.search` needs per candidate; :func:`compute_plan` for the winners)."""

    dims: ParallelDims
    grad_accum: int
    memory: MemoryPerGPU
    flops_per_step: float


def estimate_layout(cfg: TrainwrightConfig, world: int, device: Device,
                    flash: bool) -> tuple[LayoutEstimate | None, list[Problem]]:
    """(estimate, []) for a layout the plan's checks accept, else (None, its problems). The
    layout-independent checks (values, positive sizes) are the caller's, once."""
    dims = ParallelDims.build(cfg.parallelism, world)
    problems = check_static(cfg, dims) + fp8.problems(cfg, dims, device)
    if problems or dims.world % dims.model_parallel:
        return None, problems
    problems = check_batch(cfg, dims.dp)
    if problems:
        return None, problems
    batch = Batch.of(cfg.trainer, cfg.model.seq_length, dims.dp)
    problems = check_interleaving(dims, batch.grad_accum_steps)
    if problems:
        return None, problems
    mem = _memory(cfg, dims, batch, flash, gpu_kernels=device.name != "cpu")
    flops = train_flops_per_token(ResolvedModel.of(cfg.model, dims.tp)) * batch.global_batch_tokens
    return LayoutEstimate(dims, batch.grad_accum_steps, mem, flops), []


def estimate_step(cfg: TrainwrightConfig, est: LayoutEstimate, device: Device,
                  flash: bool, calibration: Optional[Calibration] = None) -> StepTime:
    """The step-time model for a layout :func:`estimate_layout` accepted."""
    dims = est.dims
    most = _most_loaded_stage(cfg.model, dims, te=device.name != "cpu")
    gpus = dims.world / cfg.cluster.ranks_per_gpu
    return predict_step(cfg, dims, est.grad_accum, device, flash, most.dense, most.expert,
                        est.flops_per_step / gpus, calibration)


def uses_flash(cfg: TrainwrightConfig, device: Device) -> bool:
    """Whether the plan counts flash attention for this config on ``device``."""
    return _uses_flash(cfg, device)
