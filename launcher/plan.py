"""The pre-flight plan: a pure function of (config, world size) that checks and derives everything.

``python -m launcher.plan [overrides]`` prints it as a table, or with ``plan.format=json`` as one
JSON object on stdout. Every validation problem is collected and printed with its fix; the exit
code is then 2. No torch.distributed, no GPU, no model is built.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass

from launcher.config import AttentionBackend, EngineName, Precision, TrainwrightConfig
from launcher.engine_choice import engine_notes
from launcher.flops import train_flops_per_token
from launcher.hardware import Device, resolve_device
from launcher.memory import (ActivationSettings, in_flight_microbatches, stage_activation_bytes,
                             state_bytes_per_param)
from launcher.params import ParamCounts, count_parameters, model_dims, stage_params
from launcher.validate import Problem, check_batch, check_schedule, check_static


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
    stage: str  # which pipeline stage is the most loaded: first, last, or all (PP=1)


@dataclass(frozen=True)
class Plan:
    world_size: int
    nodes: int
    gpus_per_node: int
    gpu: str
    engine: str
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

    def to_dict(self) -> dict:
        return asdict(self)


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


def _memory(cfg: TrainwrightConfig, world: int, batch: _Batch, flash: bool,
            gpu_kernels: bool) -> MemoryPerGPU:
    """Memory per GPU; ``gpu_kernels``: the target is a GPU, where the model uses fused kernels."""
    m, p, e = cfg.model, cfg.parallelism, cfg.engine
    tp, pp, cp, ep = (p.tensor_parallel_size, p.pipeline_parallel_size, p.context_parallel_size,
                      p.expert_parallel_size)
    d = model_dims(m, tp)
    state = dict(precision=cfg.trainer.precision, engine=e.name, zero_stage=p.zero_stage,
                 grad_fp32=e.grad_reduce_in_fp32, offload_optimizer=p.offload_optimizer,
                 offload_params=p.offload_params)
    dense_b = state_bytes_per_param(**state, shards=batch.dp * cp)
    expert_b = state_bytes_per_param(**state, shards=world // (tp * ep * pp))
    acts = ActivationSettings(
        micro_batch=cfg.trainer.micro_batch_size, seq_local=m.seq_length // cp, tp=tp,
        sequence_parallel=p.sequence_parallel, recompute=cfg.trainer.activation_recompute,
        flash=flash, elem_bytes=4 if cfg.trainer.precision == Precision.fp32 else 2,
        hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
        fused_glu=gpu_kernels)
    in_flight = in_flight_microbatches(pp, p.virtual_pipeline_parallel_size, batch.grad_accum)
    stages = [("all", True, True)] if pp == 1 else [("first", True, False), ("last", False, True)]
    best = None
    for name, first, last in stages:
        sp = stage_params(m, p, first, last)
        part = {k: getattr(dense_b, k) * sp.dense + getattr(expert_b, k) * sp.expert
                for k in ("weights", "grads", "optimizer", "cpu")}
        if p.zero_stage >= 3 and e.name == EngineName.deepspeed:  # gathered layer + prefetched one
            part["weights"] += 2 * sp.largest_layer * acts.elem_bytes
        stage_flight = in_flight if first else (1.0 if pp > 1 else in_flight)
        activations = stage_activation_bytes(d, acts, layers=m.num_layers // pp,
                                             in_flight=stage_flight, first=first, last=last)
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
    c, p = cfg.cluster, cfg.parallelism
    world = world_size or c.nodes * c.gpus_per_node
    problems = check_static(cfg, world)
    try:
        device = resolve_device(c.gpu, c.device_memory_gb, c.peak_tflops)
    except KeyError as exc:
        problems.append(Problem(("cluster.gpu",), str(exc.args[0])))
    if problems:
        raise PlanError(problems)
    tp, pp, cp, ep = (p.tensor_parallel_size, p.pipeline_parallel_size, p.context_parallel_size,
                      p.expert_parallel_size)
    dp = world // (tp * pp * cp)
    problems = check_batch(cfg, dp)
    if problems:
        raise PlanError(problems)
    batch = _batch(cfg, dp)
    problems = check_schedule(cfg, batch.steps)
    if problems:
        raise PlanError(problems)
    return _derive(cfg, world, device, batch)


def _derive(cfg: TrainwrightConfig, world: int, device: Device, batch: _Batch) -> Plan:
    m, p, t = cfg.model, cfg.parallelism, cfg.trainer
    tp, pp, cp, ep = (p.tensor_parallel_size, p.pipeline_parallel_size, p.context_parallel_size,
                      p.expert_parallel_size)
    counts = count_parameters(m, tp)
    d = model_dims(m, tp)
    flash = _uses_flash(cfg, device)
    mem = _memory(cfg, world, batch, flash, gpu_kernels=device.name != "cpu")
    one_copy, redundant = _state_totals(cfg, counts, mem, world)
    stage = stage_params(m, p, first=True, last=pp == 1)
    last = stage_params(m, p, first=pp == 1, last=True)
    flops_token = train_flops_per_token(d)
    step_tokens = batch.global_batch * m.seq_length
    peak = device.peak_tflops_fp32 if t.precision == Precision.fp32 else device.peak_tflops_bf16
    bubble = (pp - 1) / (p.virtual_pipeline_parallel_size * batch.grad_accum) if pp > 1 else 0.0
    # plan.mfu is the utilisation while computing; the pipeline bubble idles GPUs on top of it.
    step_time = flops_token * step_tokens / (world * peak * 1e12 * cfg.plan.mfu) * (1 + bubble)
    plan = Plan(
        world_size=world, nodes=cfg.cluster.nodes, gpus_per_node=cfg.cluster.gpus_per_node,
        gpu=device.name, engine=cfg.engine.name.value, tensor_parallel_size=tp,
        pipeline_parallel_size=pp, virtual_pipeline_parallel_size=p.virtual_pipeline_parallel_size,
        context_parallel_size=cp, expert_parallel_size=ep, sequence_parallel=p.sequence_parallel,
        zero_stage=p.zero_stage, data_parallel_size=batch.dp,
        expert_data_parallel_size=world // (tp * ep * pp), model_parallel_size=tp * pp * cp,
        tensor_parallel_groups=world // tp, pipeline_stages=pp, layers_per_stage=m.num_layers // pp,
        micro_batch_size=t.micro_batch_size, micro_batch_tokens=t.micro_batch_size * m.seq_length,
        grad_accum_steps=batch.grad_accum, global_batch_size=batch.global_batch,
        global_batch_tokens=step_tokens, seq_length=m.seq_length, train_steps=batch.steps,
        train_tokens=batch.tokens, params_total=counts.total,
        params_total_unpadded=counts.total_unpadded, params_active_per_token=counts.active_per_token,
        params_by_component={k: getattr(counts, k) for k in
                             ("embedding", "attention", "mlp", "norms", "output_layer")},
        vocab_size=m.vocab_size, padded_vocab_size=d.padded_vocab,
        vocab_padding_params=counts.vocab_padding,
        params_per_gpu=max(stage.total, last.total), memory_per_gpu=mem,
        gpu_memory_bytes=device.memory_bytes, training_state_bytes=one_copy,
        redundant_state_bytes=redundant, activation_recompute=t.activation_recompute.value,
        flash_attention=flash, pipeline_bubble_fraction=bubble, flops_per_token=flops_token,
        flops_per_step=flops_token * step_tokens, peak_tflops_per_gpu=peak,
        assumed_mfu=cfg.plan.mfu, effective_mfu=cfg.plan.mfu / (1 + bubble), step_time_s=step_time, tokens_per_s=step_tokens / step_time,
        time_to_train_days=batch.steps * step_time / 86400, engine_notes=tuple(engine_notes(cfg)))
    _check_fits(plan)
    return plan


def _check_fits(plan: Plan) -> None:
    cap = plan.gpu_memory_bytes
    if cap and plan.memory_per_gpu.total > cap:
        raise PlanError([Problem(("trainer.activation_recompute", "trainer.micro_batch_size"),
                                 _overflow_message(plan))], plan=plan)


def _stage_note(stage: str) -> str:
    return "" if stage == "all" else f"; {stage} pipeline stage"


def _overflow_message(plan: Plan) -> str:
    gib, mem = 2 ** 30, plan.memory_per_gpu
    fixes = []
    if plan.activation_recompute != "full":
        fixes.append("trainer.activation_recompute=full")
    if plan.micro_batch_size > 1:
        fixes.append(f"a smaller trainer.micro_batch_size (now {plan.micro_batch_size})")
    if plan.tensor_parallel_size > 1 and not plan.sequence_parallel:
        fixes.append("parallelism.sequence_parallel=true")
    fixes.append("more sharding (parallelism.tensor_parallel_size, pipeline_parallel_size, "
                 "zero_stage)")
    return (f"memory per GPU {mem.total / gib:.1f} GiB (weights {mem.weights / gib:.1f}, grads "
            f"{mem.grads / gib:.1f}, optimizer {mem.optimizer / gib:.1f}, activations "
            f"{mem.activations / gib:.1f}{_stage_note(mem.stage)}) exceeds the {plan.gpu}'s "
            f"{plan.gpu_memory_bytes / gib:.1f} GiB; try " + ", or ".join(fixes))


def print_problems(error: PlanError) -> None:
    """Every problem of a refused plan, with its fix, on stderr."""
    print(f"plan: {len(error.problems)} problem(s):\n{error}", file=sys.stderr)


def plan_or_exit(cfg: TrainwrightConfig, world_size: int | None = None) -> Plan:
    """compute_plan for entry points: on problems print them and exit with code 2."""
    from launcher.compose import CONFIG_ERROR_EXIT

    try:
        return compute_plan(cfg, world_size)
    except PlanError as exc:
        print_problems(exc)
        raise SystemExit(CONFIG_ERROR_EXIT) from None


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.plan [overrides]``: print the plan; exit 2 on any config problem."""
    from launcher.compose import CONFIG_ERROR_EXIT, compose_or_exit, to_object

    cfg = to_object(compose_or_exit(sys.argv[1:] if argv is None else argv))
    try:
        plan, error = compute_plan(cfg), None
    except PlanError as exc:
        plan, error = exc.plan, exc
    if cfg.plan.format.value == "json":
        if plan is not None:
            print(json.dumps(plan.to_dict()))
    elif plan is not None:
        from launcher.plan_report import render_plan
        render_plan(plan)
    if error is not None:
        print_problems(error)
        return CONFIG_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
