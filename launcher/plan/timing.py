"""The step-time model (:mod:`launcher.plan.step_time`) applied to one config and layout.

:func:`predict_step` reads what the model needs off the config, the layout and the device
once; the plan and the search (:mod:`launcher.search`) both call it.
"""

from __future__ import annotations

from launcher.cli.probe_first import UNPROBED
from launcher.config import Precision, TrainwrightConfig
from launcher.plan.fp8 import layers_in_fp8
from launcher.plan.hardware import Device
from launcher.plan.layer_cost import workload
from launcher.plan.params import layer_params, stage_views
from launcher.plan.step_time import (DEEPSPEED_COMPUTE_FACTOR, DataParallelWork, StepTime,
                                     data_parallel_seconds, group_links, optimizer_seconds,
                                     mixed_stage_cost, p2p_seconds, pipeline_step)
from launcher.shape.dims import ParallelDims
from launcher.shape.model import ResolvedModel


def peak_flops(cfg: TrainwrightConfig, device: Device) -> float:
    """Dense peak FLOP/s of one GPU at the training precision."""
    fp32 = cfg.trainer.precision == Precision.fp32
    return (device.peak_tflops_fp32 if fp32 else device.peak_tflops_bf16) * 1e12


def _slowdown(cfg: TrainwrightConfig, device: Device) -> float:
    """Compute time multiplier: ranks sharing one GPU, and the DeepSpeed engine's overhead on a
    GPU (its per-parameter gradient copies cost a CPU step nothing measurable: the tiny model
    in fp32 on 2 CPU ranks, 0.779 s a step with DeepSpeed against 0.801 s with Megatron-Core,
    docs/plan.md)."""
    deepspeed = cfg.engine.name.value == "deepspeed" and device.name != "cpu"
    return cfg.cluster.ranks_per_gpu * (DEEPSPEED_COMPUTE_FACTOR if deepspeed else 1.0)


def _dp_work(cfg: TrainwrightConfig, dims: ParallelDims, dense: int, expert: int,
             elem: int) -> DataParallelWork:
    p, e = cfg.parallelism, cfg.engine
    engine = e.name.value
    return DataParallelWork(
        engine=engine, zero_stage=p.zero_stage, dense_params=dense, expert_params=expert,
        dense_shards=dims.dense_shards, expert_shards=dims.edp,
        grad_bytes=4 if (e.grad_reduce_in_fp32 or elem == 4) else 2, param_bytes=elem,
        overlap_grad=e.overlap_grad_reduce,
        overlap_param=engine == "megatron" and e.overlap_param_gather and p.zero_stage == 1,
        bucket_elements=e.reduce_bucket_size)


def predict_step(cfg: TrainwrightConfig, dims: ParallelDims, grad_accum: int, device: Device,
                 flash: bool, stage_dense: int, stage_expert: int,
                 model_flops_per_gpu: float, calibration=None) -> StepTime:
    """Seconds of one optimizer step (see :mod:`launcher.plan.step_time`); ``stage_dense`` /
    ``stage_expert``: parameters of the most loaded GPU; ``model_flops_per_gpu``: the step's
    model FLOPs per GPU (for the compute-only MFU). With a ``calibration``
    (:class:`launcher.plan.calibrated.Calibration`) that measured this model at this
    tensor-parallel size, the measured composition (:func:`calibrated_step`)."""
    if calibration is not None:
        measured = calibrated_step(calibration, cfg, dims, grad_accum, stage_dense, stage_expert,
                                   model_flops_per_gpu, peak_flops(cfg, device))
        if measured is not None:
            return measured
    m, t, c = cfg.model, cfg.trainer, cfg.cluster
    d = ResolvedModel.of(m, dims.tp)
    elem = 4 if t.precision == Precision.fp32 else 2
    peak, slowdown = peak_flops(cfg, device), _slowdown(cfg, device)
    w = workload(d, micro_batch=t.micro_batch_size, tp=dims.tp, sp=dims.sequence_parallel,
                 cp=dims.cp, ep=dims.ep, recompute=t.activation_recompute.value, flash=flash,
                 elem=elem, peak_flops=peak, dev=device, slowdown=slowdown)
    links = group_links(dims, c.gpus_per_node, c.ranks_per_gpu, device)
    numbers = dims.stage_layer_numbers(m.num_layers)
    costs = [mixed_stage_cost(w, links, _stage_kinds(cfg, d, dims, numbers[i], device),
                              first=i == 0, last=i == dims.pp - 1)
             for i in stage_views(d, dims)]
    pipe = pipeline_step(costs, dims, grad_accum)
    work = _dp_work(cfg, dims, stage_dense, stage_expert, elem)
    dp_s = data_parallel_seconds(work, links, grad_accum, pipe["backward_window"],
                                 pipe["forward_window"])
    sharded = cfg.parallelism.zero_stage >= 1
    opt_params = (stage_dense / (dims.dense_shards if sharded else 1)
                  + stage_expert / (dims.edp if sharded else 1))
    opt_s = optimizer_seconds(opt_params, device, cfg.parallelism.offload_optimizer,
                              work.grad_bytes, elem, c.ranks_per_gpu)
    compute = pipe["compute"]
    return StepTime(
        compute=compute, tensor_parallel=pipe["tensor_parallel"],
        context_parallel=pipe["context_parallel"], expert_parallel=pipe["expert_parallel"],
        pipeline_bubble=pipe["pipeline_bubble"], pipeline_p2p=p2p_seconds(w, dims, links,
                                                                         grad_accum),
        data_parallel=dp_s, optimizer=opt_s,
        compute_only_mfu=model_flops_per_gpu / (compute * peak) if compute else 0.0)


def _stage_kinds(cfg: TrainwrightConfig, d: ResolvedModel, dims: ParallelDims, numbers,
                 device: Device) -> list[tuple]:
    """(layer, count, its parameters on one GPU, of the count in FP8) of each kind of layer a
    stage with layers ``numbers`` holds (:func:`launcher.plan.step_time.mixed_stage_cost`)."""
    fp8 = layers_in_fp8(cfg)
    out = []
    for layer, n in d.layer_kinds(numbers):
        mine = [i for i in numbers if d.moe_layer(i) == (layer.experts > 0)]
        params = layer_params(layer, dims.tp, dims.ep, te=device.name != "cpu").total
        out.append((layer, n, params, sum(fp8[i] for i in mine)))
    return out


def calibrated_step(cal, cfg: TrainwrightConfig, dims: ParallelDims, grad_accum: int,
                    stage_dense: int, stage_expert: int, model_flops_per_gpu: float,
                    peak: float) -> StepTime | None:
    """The step from a machine profile's measured parts (:mod:`launcher.plan.calibrated`);
    None when the profile has no passes for this model and tensor-parallel size. The engine's
    framework cost: where the probe ran the engine at this layout at two depths, what the line
    through them says at this depth less the composed parts (the step is then the engine's own
    measurement, extended in depth); at one depth, that run less its composed parts; else the
    nearest measured layout's."""
    import dataclasses

    from launcher.plan.calibrated import engine_key_of, model_key

    if unprobed(cfg, dims):
        return None
    key = model_key(dataclasses.asdict(cfg.model), cfg.trainer.precision)
    cost = cal.passes(key, dims.tp, cfg.trainer.micro_batch_size)
    if cost is None:
        return None
    parts = _calibrated_parts(cal, cost, cfg, dims, grad_accum, cfg.model.num_layers,
                              stage_dense + stage_expert)
    layout = engine_key_of(cfg, dims, grad_accum)
    records = cal.engine(layout)
    framework = 0.0
    if len(records) >= 2:  # the engine itself at two depths of this layout: its line in depth
        from launcher.plan.calibrated import interpolate

        at = interpolate([(int(r["layers"]), r["seconds"]) for r in records],
                         cfg.model.num_layers)
        framework = at - sum(parts.values())
    elif records:
        layers = int(records[0]["layers"])
        small = _calibrated_parts(cal, cost, cfg, dims, grad_accum, layers,
                                  (stage_dense + stage_expert) * layers / cfg.model.num_layers)
        framework = records[0]["seconds"] - sum(small.values())
    else:
        framework = _carried_framework(cal, cfg, dims, grad_accum, cal.nearest_engine(layout),
                                       sum(parts.values()), stage_dense + stage_expert)
    compute = parts["compute"]
    return StepTime(**parts, framework=framework, measured=True,
                    compute_only_mfu=model_flops_per_gpu / (compute * peak) if compute else 0.0)


def _carried_framework(cal, cfg: TrainwrightConfig, dims: ParallelDims, grad_accum: int,
                       records: list, composed_here: float, stage_params: float) -> float:
    """The framework cost of a layout the probe did not run, from ``records`` (another layout's
    engine runs: :meth:`Calibration.nearest_engine`): what its deepest run at its own batch
    split left beyond its composed parts, plus, where it was also run in smaller micro-batches
    (more of them a step), the cost of each micro-batch this layout has more (or fewer) than
    it. Parts that overestimated that layout (a negative residual: overlap, or a probe's
    passes taken under load) overestimate this one in proportion, so that the step never comes
    out at zero or below."""
    if not records:
        return 0.0
    accum = min(int(r["key"]["grad_accum"]) for r in records)
    base = max((r for r in records if int(r["key"]["grad_accum"]) == accum),
               key=lambda r: int(r["layers"]))
    residual, composed = _measured_residual(cal, cfg, dims, base, stage_params)
    if residual < 0 and composed > 0:
        residual *= composed_here / composed
    return residual + _per_micro_batch(cal, cfg, dims, records, stage_params) \
        * (grad_accum - accum)


def _per_micro_batch(cal, cfg: TrainwrightConfig, dims: ParallelDims, records: list,
                     stage_params: float) -> float:
    """Seconds the framework adds per micro-batch (never below 0), from two runs of one depth
    at two accumulation counts (0 when the records have no such pair)."""
    depth = min(int(r["layers"]) for r in records)
    runs = sorted(((int(r["key"]["grad_accum"]), r) for r in records
                   if int(r["layers"]) == depth), key=lambda run: run[0])
    if len(runs) < 2 or runs[0][0] == runs[-1][0]:
        return 0.0
    (m0, r0), (m1, r1) = runs[0], runs[-1]
    residual0 = _measured_residual(cal, cfg, dims, r0, stage_params)[0]
    residual1 = _measured_residual(cal, cfg, dims, r1, stage_params)[0]
    return max(0.0, (residual1 - residual0) / (m1 - m0))


def unprobed(cfg: TrainwrightConfig, dims: ParallelDims) -> str:
    """Why no profile can give this layout's step time ("" when one can): the probe times
    dense passes at the full sequence, not context parallelism's split sequence and its ring
    exchange, nor the experts' routing and all-to-all; composing them as dense would label a
    guess "measured"."""
    what = ([f"context parallelism (context_parallel_size={dims.cp})"] * (dims.cp > 1)
            + [f"mixture-of-experts layers (num_experts={cfg.model.num_experts}: expert compute "
               "and all-to-all)"] * bool(cfg.model.num_experts))
    return f"{UNPROBED} {' or '.join(what)}" if what else ""


def _measured_residual(cal, cfg: TrainwrightConfig, dims: ParallelDims, record: dict,
                       stage_params: float) -> tuple[float, float]:
    """(what an engine record measured at another layout of this model left beyond its own
    composed parts, those parts' sum), at its layout, micro-batch, accumulation and depth: the
    framework cost an unmeasured layout is given. ``stage_params``: this layout's most loaded
    stage."""
    import dataclasses

    from launcher.config import ParallelismConfig

    k = record["key"]
    other = ParallelDims.build(ParallelismConfig(
        tensor_parallel_size=k["tp"], pipeline_parallel_size=k["pp"],
        virtual_pipeline_parallel_size=k["vpp"], context_parallel_size=k["cp"],
        expert_parallel_size=k["ep"], sequence_parallel=k["sp"],
        zero_stage=k["zero_stage"]), k["tp"] * k["pp"] * k["cp"] * k["dp"])
    cost = cal.passes(model_key_of(cfg), other.tp, k["micro_batch"])
    if cost is None:
        return 0.0, 0.0
    layers = int(record["layers"])
    run = dataclasses.replace(cfg, trainer=dataclasses.replace(
        cfg.trainer, micro_batch_size=k["micro_batch"]))
    params = stage_params * (dims.tp * dims.pp) / (other.tp * other.pp) \
        * layers / cfg.model.num_layers
    composed = sum(_calibrated_parts(cal, cost, run, other, k["grad_accum"], layers,
                                     params).values())
    return record["seconds"] - composed, composed


def model_key_of(cfg: TrainwrightConfig) -> dict:
    import dataclasses

    from launcher.plan.calibrated import model_key

    return model_key(dataclasses.asdict(cfg.model), cfg.trainer.precision)


def _calibrated_parts(cal, cost, cfg: TrainwrightConfig, dims: ParallelDims, grad_accum: int,
                      num_layers: int, stage_params: float) -> dict:
    """Seconds by cause (StepTime's fields) of a model of ``num_layers`` layers whose most loaded
    stage holds ``stage_params`` parameters on one GPU."""
    from launcher.plan.calibrated import data_parallel_s, stage_costs

    t, e = cfg.trainer, cfg.engine
    d = ResolvedModel.of(cfg.model, dims.tp)
    elem = 4 if t.precision == Precision.fp32 else 2
    tokens = t.micro_batch_size * d.seq // dims.cp
    costs = stage_costs(cal, cost, dims=dims, layers=dims.stage_layers(num_layers),
                        tokens=tokens, hidden=d.hidden, elem=elem,
                        recompute=t.activation_recompute.value)
    pipe = pipeline_step(costs, dims, grad_accum)
    p2p = 0.0
    if dims.pp > 1:
        transfers = 2 * (grad_accum + dims.pp - 1) if dims.vpp == 1 else 2 * (dims.pp - 1)
        shards = dims.tp if dims.sequence_parallel else 1
        p2p = transfers * (cal.collective("send_recv", tokens * d.hidden * elem / shards, 2)
                           or 0.0)  # between two neighbouring stages
    grad_bytes = 4 if (e.grad_reduce_in_fp32 or elem == 4) else 2
    zero = cfg.parallelism.zero_stage
    dp = data_parallel_s(cal, engine=e.name.value, zero_stage=zero, dp=dims.dense_shards,
                         params=stage_params, grad_bytes=grad_bytes, param_bytes=elem,
                         grad_accum=grad_accum)
    shard = stage_params / (dims.dense_shards if zero >= 1 else 1)
    return dict(compute=pipe["compute"], tensor_parallel=pipe["tensor_parallel"],
                context_parallel=0.0, expert_parallel=0.0,
                pipeline_bubble=pipe["pipeline_bubble"], pipeline_p2p=p2p, data_parallel=dp,
                optimizer=cal.optimizer(shard) or 0.0)
