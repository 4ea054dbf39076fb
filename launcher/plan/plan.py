"""The pre-flight plan: a pure function of (config, world size) that checks and derives everything.

``python -m launcher.plan [overrides]`` (:mod:`launcher.plan.__main__`) prints it as a table, or
with ``plan.format=json`` as one JSON object on stdout. Every validation problem is collected and printed with its fix; the exit
code is then 2. No torch.distributed, no GPU, no model is built.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field

from launcher.config import AttentionBackend, Precision, TrainwrightConfig, loss_kernel
from launcher.engines import spec
from launcher.plan import fp8
from launcher.plan.engine_choice import engine_notes
from launcher.plan.flops import train_flops_per_token
from launcher.plan.hardware import Device, resolve_device
from launcher.plan.memory import (ActivationSettings, in_flight_microbatches,
                                  stage_activation_bytes, state_bytes_per_param)
from launcher.plan.params import ParamCounts, StageParams, count_parameters, stage_params
from launcher.plan.step_time import StepTime
from launcher.plan.timing import peak_flops, predict_step
from launcher.plan.validate import (Problem, check_batch, check_interleaving, check_positive,
                                    check_static, check_values, schedule_warnings)
from launcher.shape.dims import ParallelDims, cluster_world_size
from launcher.shape import Batch
from launcher.shape.model import ResolvedModel


class PlanError(Exception):
    """The config cannot be trained as given; ``problems`` says every reason and its fix."""

    def __init__(self, problems: list[Problem], plan: "Plan | None" = None):
        self.problems = problems
        self.plan = plan  # the derived plan, when only the memory check failed
        super().__init__("\n".join(f"- {p}" for p in problems))


@dataclass(frozen=True)
class MemoryPerGPU:
    """Bytes on the most loaded GPU."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    total: int
    cpu_offload: int  # optimizer state / parameters kept in host memory instead
    stage: str  # the most loaded pipeline stage: first, middle (the second), last, all (PP=1)


@dataclass(frozen=True)
class Plan:
    """Everything derived from a config. The flat layout fields (world_size ...
    layers_per_stage) are read off ``dims``, the one ParallelDims of the run."""

    world_size: int
    nodes: int
    gpus_per_node: int
    ranks_per_gpu: int  # training processes sharing each GPU (cluster.ranks_per_gpu)
    gpu: str
    engine: str
    dims: ParallelDims
    tensor_parallel_size: int
    pipeline_parallel_size: int
    virtual_pipeline_parallel_size: int
    context_parallel_size: int
    expert_parallel_size: int
    sequence_parallel: bool
    zero_stage: int
    data_parallel_size: int
    expert_data_parallel_size: int
    model_parallel_size: int
    tensor_parallel_groups: int
    pipeline_stages: int
    layers_per_stage: int
    micro_batch_size: int
    micro_batch_tokens: int
    grad_accum_steps: int
    global_batch_size: int
    global_batch_tokens: int
    seq_length: int
    train_steps: int
    train_tokens: int
    params_total: int
    params_total_unpadded: int
    params_active_per_token: int
    params_by_component: dict
    vocab_size: int
    padded_vocab_size: int
    vocab_padding_params: int
    params_per_gpu: int
    memory_per_gpu: MemoryPerGPU
    gpu_memory_bytes: int
    training_state_bytes: int
    redundant_state_bytes: int
    activation_recompute: str
    flash_attention: bool
    pipeline_bubble_fraction: float
    flops_per_token: float
    flops_per_step: float
    peak_tflops_per_gpu: float
    assumed_mfu: float
    effective_mfu: float  # assumed_mfu diluted by the pipeline bubble
    step_time_s: float
    tokens_per_s: float
    time_to_train_days: float
    engine_notes: tuple = ()  # why the chosen engine runs this layout, what the other would not
    warnings: tuple = ()  # worth a word, not a refusal (e.g. warmup longer than the run)
    stage_layers: tuple = ()  # transformer layers of every pipeline stage, first to last
    step_time_parts: dict = field(default_factory=dict)  # seconds per cause (step_time.PARTS)
    dominant_cost: str = ""  # the largest cost besides compute ("compute" if none matters)
    mfu: float = 0.0  # predicted model FLOPs utilisation of the whole step
    flops_per_token_causal: float = 0.0  # causal attention counted half (Megatron-LM's logs)
    mfu_causal: float = 0.0  # mfu by that count
    fp8_layers: str = ""  # what runs FP8 GEMMs (trainer.precision=fp8), "" otherwise

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def batch(self) -> Batch:
        """The run's batch (what the engines build from)."""
        return Batch(micro_batch_size=self.micro_batch_size, seq_length=self.seq_length,
                     data_parallel_size=self.data_parallel_size,
                     grad_accum_steps=self.grad_accum_steps,
                     global_batch_size=self.global_batch_size, train_steps=self.train_steps,
                     train_tokens=self.train_tokens)


@dataclass(frozen=True)
class _Batch:
    dp: int
    grad_accum: int
    global_batch: int
    steps: int
    tokens: int


def _batch(cfg: TrainwrightConfig, dp: int) -> _Batch:
    t, seq = cfg.trainer, cfg.model.seq_length
    global_batch = t.global_batch_size or t.micro_batch_size * dp
    grad_accum = global_batch // (t.micro_batch_size * dp)
    step_tokens = global_batch * seq
    steps = t.train_steps or math.ceil(t.train_tokens / step_tokens)
    tokens = t.train_tokens or steps * step_tokens
    return _Batch(dp, grad_accum, global_batch, steps, tokens)


def _uses_flash(cfg: TrainwrightConfig, device: Device) -> bool:
    backend = cfg.trainer.attention_backend
    if backend == AttentionBackend.auto:
        return device.name != "cpu"
    return backend == AttentionBackend.flash


def _stage_views(dims: ParallelDims, num_layers: int) -> list[tuple[str, int, int]]:
    """(name, index, layers) of the stages that can be the most loaded: the first (most
    micro-batches in flight, the embedding), the second (the most in flight of the middle
    stages, which hold equal layers) and the last (the output layer and logits)."""
    if dims.pp == 1:
        return [("all", 0, num_layers)]
    layers = dims.stage_layers(num_layers)
    middle = [("middle", 1, layers[1])] if dims.pp > 2 else []
    return [("first", 0, layers[0])] + middle + [("last", dims.pp - 1, layers[-1])]


def _memory(cfg: TrainwrightConfig, dims: ParallelDims, batch: _Batch, flash: bool,
            gpu_kernels: bool) -> MemoryPerGPU:
    """Memory per GPU; ``gpu_kernels``: the target is a GPU, where the model uses fused kernels."""
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
    best = None
    fp8_layers = fp8.stage_fp8_layers(cfg, dims.stage_layers(m.num_layers))
    for name, index, layers in _stage_views(dims, m.num_layers):
        first, last = index == 0, index == dims.pp - 1
        sp = stage_params(m, dims, first, last, layers)
        part = {k: getattr(dense_b, k) * sp.dense + getattr(expert_b, k) * sp.expert
                for k in ("weights", "grads", "optimizer", "cpu")}
        part["weights"] += gathered * sp.largest_layer * acts.elem_bytes  # ZeRO-3 gathers
        part["weights"] += fp8.extra_state_bytes(cfg, d, dims, fp8_layers[index])
        activations = stage_activation_bytes(
            d, acts, layers=layers, in_flight=in_flight_microbatches(dims, batch.grad_accum, index),
            first=first, last=last)
        total = part["weights"] + part["grads"] + part["optimizer"] + activations
        candidate = MemoryPerGPU(int(part["weights"]), int(part["grads"]), int(part["optimizer"]),
                                 int(activations), int(total), int(part["cpu"]), name)
        if best is None or candidate.total > best.total:
            best = candidate
    return best


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


def compute_plan(cfg: TrainwrightConfig, world_size: int | None = None) -> Plan:
    """Check ``cfg`` and derive the plan; raise PlanError listing every problem."""
    c = cfg.cluster
    dims, problems = _layout(cfg, world_size or cluster_world_size(c))
    device = None
    try:
        device = resolve_device(c.gpu, c.device_memory_gb, c.peak_tflops)
    except KeyError as exc:
        problems.append(Problem(("cluster.gpu",), str(exc.args[0])))
    if dims is not None:
        problems += fp8.problems(cfg, dims, device)
    batch = None
    if dims is not None and dims.dp >= 1 and dims.world % dims.model_parallel == 0:
        batch_problems = check_batch(cfg, dims.dp)  # independent of the model-shape problems
        problems += batch_problems
        batch = None if batch_problems else _batch(cfg, dims.dp)
    if problems:
        raise PlanError(problems)
    return _derive(cfg, dims, device, batch)


def _layout(cfg: TrainwrightConfig, world: int) -> tuple[ParallelDims | None, list[Problem]]:
    """The run's ParallelDims, built once the sizes are positive, and every static problem."""
    problems = check_values(cfg)
    positive = check_positive(cfg)
    if positive:  # the layout and divisibility checks would divide by zero
        return None, problems + positive
    dims = ParallelDims.build(cfg.parallelism, world)
    return dims, problems + check_static(cfg, dims)


def _layout_fields(dims: ParallelDims, num_layers: int) -> dict:
    """The Plan's flat layout fields (plan.json keys the runtime and tools read), from ``dims``."""
    return dict(
        world_size=dims.world, tensor_parallel_size=dims.tp, pipeline_parallel_size=dims.pp,
        virtual_pipeline_parallel_size=dims.vpp, context_parallel_size=dims.cp,
        expert_parallel_size=dims.ep, sequence_parallel=dims.sequence_parallel,
        data_parallel_size=dims.dp, expert_data_parallel_size=dims.edp,
        model_parallel_size=dims.model_parallel, tensor_parallel_groups=dims.tp_groups,
        pipeline_stages=dims.pp, layers_per_stage=dims.layers_per_stage(num_layers))


def _step(cfg: TrainwrightConfig, dims: ParallelDims, device: Device, batch: _Batch,
          flash: bool, most: StageParams, flops_step: float) -> tuple[StepTime, float, float]:
    """(step-time breakdown, step seconds, MFU while computing): the step-time model, or with
    plan.mfu > 0 the flat assumption (that MFU while computing, the bubble on top)."""
    gpus = dims.world / cfg.cluster.ranks_per_gpu  # ranks sharing a GPU share its FLOP/s
    peak = peak_flops(cfg, device)
    model = predict_step(cfg, dims, batch.grad_accum, device, flash, most.dense, most.expert,
                         flops_step / gpus)
    if cfg.plan.mfu > 0:
        flat = flops_step / (gpus * peak * cfg.plan.mfu) * (1 + dims.bubble_fraction(batch.grad_accum))
        return model, flat, cfg.plan.mfu
    return model, model.total, model.compute_only_mfu


def _derive(cfg: TrainwrightConfig, dims: ParallelDims, device: Device, batch: _Batch) -> Plan:
    m, t, c = cfg.model, cfg.trainer, cfg.cluster
    counts = count_parameters(m, dims.tp)
    d = ResolvedModel.of(m, dims.tp)
    flash = _uses_flash(cfg, device)
    mem = _memory(cfg, dims, batch, flash, gpu_kernels=device.name != "cpu")
    one_copy, redundant = _state_totals(cfg, counts, mem, dims.world)
    stage = stage_params(m, dims, first=True, last=dims.pp == 1)
    last = stage_params(m, dims, first=dims.pp == 1, last=True)
    middle = stage_params(m, dims, first=False, last=False) if dims.pp > 2 else stage
    most = max((stage, middle, last), key=lambda s: s.total)
    flops_token = train_flops_per_token(d)
    causal_token = train_flops_per_token(d, causal=True)  # Megatron-LM's count
    step_tokens = batch.global_batch * m.seq_length
    peak = peak_flops(cfg, device) / 1e12
    flops_step = flops_token * step_tokens
    breakdown, step_time, computing_mfu = _step(cfg, dims, device, batch, flash, most, flops_step)
    mfu = flops_step / (dims.world / c.ranks_per_gpu * peak * 1e12 * step_time)
    plan = Plan(
        **_layout_fields(dims, m.num_layers), dims=dims, nodes=c.nodes,
        gpus_per_node=c.gpus_per_node, ranks_per_gpu=c.ranks_per_gpu, gpu=device.name,
        engine=cfg.engine.name.value, zero_stage=cfg.parallelism.zero_stage,
        micro_batch_size=t.micro_batch_size, micro_batch_tokens=t.micro_batch_size * m.seq_length,
        grad_accum_steps=batch.grad_accum, global_batch_size=batch.global_batch,
        global_batch_tokens=step_tokens, seq_length=m.seq_length, train_steps=batch.steps,
        train_tokens=batch.tokens, params_total=counts.total,
        params_total_unpadded=counts.total_unpadded, params_active_per_token=counts.active_per_token,
        params_by_component={k: getattr(counts, k) for k in
                             ("embedding", "attention", "mlp", "norms", "output_layer")},
        vocab_size=m.vocab_size, padded_vocab_size=d.padded_vocab,
        vocab_padding_params=counts.vocab_padding,
        params_per_gpu=most.total, memory_per_gpu=mem,
        gpu_memory_bytes=device.memory_bytes, training_state_bytes=one_copy,
        redundant_state_bytes=redundant, activation_recompute=t.activation_recompute.value,
        flash_attention=flash, pipeline_bubble_fraction=dims.bubble_fraction(batch.grad_accum),
        flops_per_token=flops_token, flops_per_step=flops_step, peak_tflops_per_gpu=peak,
        assumed_mfu=computing_mfu, effective_mfu=mfu, step_time_s=step_time,
        tokens_per_s=step_tokens / step_time, time_to_train_days=batch.steps * step_time / 86400,
        engine_notes=tuple(engine_notes(cfg)),
        warnings=tuple(schedule_warnings(cfg, batch.steps)
                       + [str(x) for x in check_interleaving(dims, batch.grad_accum)]),
        stage_layers=dims.stage_layers(m.num_layers), step_time_parts=breakdown.parts(),
        dominant_cost=breakdown.dominant, mfu=mfu, flops_per_token_causal=causal_token,
        mfu_causal=mfu * causal_token / flops_token, fp8_layers=fp8.describe(cfg))
    _check_fits(plan)
    return plan


def _check_fits(plan: Plan) -> None:
    """Refuse a plan whose ranks on one GPU (ranks_per_gpu of them) need more than its memory."""
    cap, n = plan.gpu_memory_bytes, plan.ranks_per_gpu
    if cap and n * plan.memory_per_gpu.total > cap:
        keys = ("trainer.activation_recompute", "trainer.micro_batch_size")
        if n > 1:
            keys = ("cluster.ranks_per_gpu",) + keys
        raise PlanError([Problem(keys, _overflow_message(plan))], plan=plan)


def _stage_note(stage: str) -> str:
    return "" if stage == "all" else f"; {stage} pipeline stage"


def _memory_fixes(plan: Plan) -> list[str]:
    fixes = []
    if plan.ranks_per_gpu > 1:
        fixes.append(f"fewer cluster.ranks_per_gpu (now {plan.ranks_per_gpu})")
    if plan.activation_recompute != "full":
        fixes.append("trainer.activation_recompute=full")
    if plan.micro_batch_size > 1:
        fixes.append(f"a smaller trainer.micro_batch_size (now {plan.micro_batch_size})")
    if plan.dims.tp > 1 and not plan.dims.sequence_parallel:
        fixes.append("parallelism.sequence_parallel=true")
    fixes.append("more sharding (parallelism.tensor_parallel_size, pipeline_parallel_size, "
                 "zero_stage)")
    if plan.ranks_per_gpu > 1:
        fixes.append("a smaller model (model.num_layers, hidden_size, seq_length)")
    return fixes


def _overflow_message(plan: Plan) -> str:
    gib, mem, n = 2 ** 30, plan.memory_per_gpu, plan.ranks_per_gpu
    parts = (f"weights {mem.weights / gib:.1f}, grads {mem.grads / gib:.1f}, optimizer "
             f"{mem.optimizer / gib:.1f}, activations {mem.activations / gib:.1f}"
             f"{_stage_note(mem.stage)}")
    fixes = "; try " + ", or ".join(_memory_fixes(plan))
    cap = plan.gpu_memory_bytes / gib
    if n == 1:
        return (f"memory per GPU {mem.total / gib:.1f} GiB ({parts}) exceeds the {plan.gpu}'s "
                f"{cap:.1f} GiB" + fixes)
    return (f"cluster.ranks_per_gpu={n} ranks share each {plan.gpu}: {n} x "
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
    """compute_plan for entry points: on problems print them and exit with code 2."""
    from launcher.core.exits import CONFIG_ERROR_EXIT

    try:
        plan = compute_plan(cfg, world_size)
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
    batch = _batch(cfg, dims.dp)
    problems = check_interleaving(dims, batch.grad_accum)
    if problems:
        return None, problems
    mem = _memory(cfg, dims, batch, flash, gpu_kernels=device.name != "cpu")
    flops = train_flops_per_token(ResolvedModel.of(cfg.model, dims.tp)) * batch.global_batch \
        * cfg.model.seq_length
    return LayoutEstimate(dims, batch.grad_accum, mem, flops), []


def estimate_step(cfg: TrainwrightConfig, est: LayoutEstimate, device: Device,
                  flash: bool) -> StepTime:
    """The step-time model for a layout :func:`estimate_layout` accepted."""
    m, dims = cfg.model, est.dims
    stages = [stage_params(m, dims, True, dims.pp == 1), stage_params(m, dims, dims.pp == 1, True)]
    if dims.pp > 2:
        stages.append(stage_params(m, dims, False, False))
    most = max(stages, key=lambda s: s.total)
    gpus = dims.world / cfg.cluster.ranks_per_gpu
    return predict_step(cfg, dims, est.grad_accum, device, flash, most.dense, most.expert,
                        est.flops_per_step / gpus)


def uses_flash(cfg: TrainwrightConfig, device: Device) -> bool:
    """Whether the plan counts flash attention for this config on ``device``."""
    return _uses_flash(cfg, device)
