"""The machine probe on a job's own ranks: :func:`probe_rank` measures, rank 0 stores.

Every rank measures at once (the node's ranks share its memory bandwidth and cores in training
too), each figure is the slowest rank's median after a warm-up, and rank 0 merges them into the
machine profile (:mod:`launcher.plan.profile`):

* ``passes``: forward + loss + backward of Megatron-Core's GPTModel at one rank's shapes, for
  every tensor-parallel size the node allows and three micro-batch sizes (1, the job's, twice
  it: :func:`pass_micro_batches`; :mod:`launcher.engines.probe.passes`), with 1 and 3 layers
  (one layer's cost is their difference), and the model's two ends timed on their own: the
  embedding, and the output layer with the loss, each per micro-batch;
* ``optimizer``: torch's AdamW over the rank's share of the fp32 weights, at two sizes;
* ``collectives``: all-reduce, reduce-scatter, all-gather, all-to-all and send/recv among the
  node's ranks at a small and the job's sizes (gloo on CPU, NCCL on GPU);
* ``engine``: the job's engine at its layout with the fewest layers the layout allows (one per
  model chunk) and at the model's depth, stepped as training steps it, and once more in
  micro-batches of one sample; the other engine too, where it runs the layout
  (``launcher.probe``): what the parts above leave out (the framework's fixed cost per step,
  and per micro-batch) is the plan's residual for that engine and layout, and for the layouts
  planned from it.

Figures carry their shapes and sizes as ``key``; a later probe replaces the records with the
same key and keeps the others, so one profile serves several models and layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from launcher.parallel import collectives
from launcher.plan.calibrated import engine_key, model_key

REPS = 3
"""Timed repetitions of each figure (the median is kept), after one warm-up."""


def tp_choices(model, local_ranks: int) -> list[int]:
    """Tensor-parallel sizes a layout on this node may use: divisors of the local ranks that
    divide the heads and query groups."""
    from launcher.shape import ResolvedModel

    r = ResolvedModel.of(model, 1)
    return [t for t in range(1, local_ranks + 1)
            if local_ranks % t == 0 and r.heads % t == 0 and r.groups % t == 0]


def pass_micro_batches(micro_batch: int) -> list[int]:
    """The micro-batch sizes the passes are timed at: the job's, twice it (the search's larger
    ones) and 1 (its smaller ones: a pass of one sample is not a quarter of one of four; on this
    project's 2-core EPYC the tiny model's step of 4 x 1 samples took 1.3x that of 1 x 4, which
    the plan, scaling micro-batch 4 down in proportion, priced the same)."""
    return sorted({1, micro_batch, 2 * micro_batch})


def pass_records(cfg, *, local_ranks: int, micro_batches: list[int]) -> list[dict]:
    """The ``passes`` section (module docstring): per TP size and micro-batch, one layer, the
    embedding and the output layer with the loss, in seconds per micro-batch."""
    from launcher.engines.probe.passes import ends_seconds, pass_seconds, rank_shard

    records = []
    key = model_key(dataclasses.asdict(cfg.model), cfg.trainer.precision)
    timing = dict(reps=REPS, barrier=collectives.barrier,
                  max_over_ranks=lambda x: collectives.max_floats([x])[0])

    for tp in tp_choices(cfg.model, local_ranks):
        for b in micro_batches:  # each figure the slowest rank's
            one, three, embedding, output = collectives.max_floats([
                *(pass_seconds(rank_shard(cfg.model, tp, n), cfg.trainer, micro_batch=b,
                               **timing) for n in (1, 3)),
                *ends_seconds(rank_shard(cfg.model, tp, 1), cfg.trainer, micro_batch=b,
                              **timing)])
            records.append({"key": {**key, "tp": tp, "micro_batch": b},
                            "layer_s": max(0.0, (three - one) / 2),
                            "embedding_s": embedding, "output_s": output})
    return records


def optimizer_records(numel: int, tensors: int) -> list[dict]:
    """The ``optimizer`` section: AdamW over ``numel`` and a quarter of it."""
    from launcher.engines.probe.kernels import adam_seconds
    from launcher.engines.probe.passes import compute_device

    out = []
    for n in sorted({max(tensors, numel // 4), max(tensors, numel)}):
        seconds = collectives.max_floats([adam_seconds(n, tensors, REPS, compute_device())])[0]
        out.append({"key": {"numel": n, "tensors": tensors}, "seconds": seconds})
    return out


def collective_records(sizes: dict, element_bytes: int, ranks: int) -> list[dict]:
    """The ``collectives`` section: every op at one element and at each of ``sizes`` (name ->
    elements), over groups of every size :func:`collectives.group_sizes` gives (the world split
    into such groups, all measuring at once, as a layout's TP or DP groups run), keyed by the
    group's size: the plan looks a group's figure up by its size."""
    import torch

    dtype = {2: torch.bfloat16, 4: torch.float32}[element_bytes]
    out = []
    for size in collectives.group_sizes(ranks):
        group = collectives.subgroup_of_size(size)
        for op in collectives.COLLECTIVE_OPS:
            for numel in sorted({size, *sizes.values()}):
                seconds = collectives.collective_seconds(op, numel, dtype, reps=REPS, group=group)
                out.append({"key": {"op": op, "bytes": numel * element_bytes, "ranks": size},
                            "seconds": collectives.max_floats([seconds])[0]})
    return out


ENGINE_WARM_STEPS = 5
"""Steps the engine runs before it is timed: a CPU rank takes several to reach its pace
(oneDNN's primitives, the allocator's pools)."""
ENGINE_REPS = 5
"""Timed engine steps (the median is kept): the engine's figure is extrapolated in depth, so its
noise is amplified; more repetitions than the kernels'."""
ENGINE_DEPTHS = (1, 12)
"""Layers per model chunk the engine is run at (the second capped by the model's depth, so
that most jobs' engine is timed at their own depth). With 3 as the second, gpt2_124m's 12 layers
came out 19-47% slow in five probes on two hosts: the line through 1 and 3 layers, extended,
misses what a deeper model overlaps (the gradient reduce behind the backward) and multiplies
the noise of its two points by 5.5."""


def engine_records(cfg, plan, config: Mapping, build: Callable) -> list[dict]:
    """The ``engine`` section's records: the job's engine at its layout at
    :data:`ENGINE_DEPTHS` layers per model chunk, :data:`ENGINE_REPS` steps timed after
    :data:`ENGINE_WARM_STEPS` (``config``: the job's resolved config, plain). Two depths give
    the layer's cost inside the engine at this layout (its collectives, hooks and Python
    included) as well as the fixed part; one more run at the smaller depth in micro-batches of
    one sample (:func:`_split_batch`) gives the framework's cost per micro-batch (the
    schedule, the loader's hand-over, gradient accumulation), which a layout with another
    accumulation count pays a different number of times."""
    depths = engine_depths(cfg.model.num_layers, plan.dims)
    key = engine_key(plan.to_dict(), config)
    out = [_engine_record(cfg, plan.batch, key, build, layers) for layers in depths]
    return out + [_engine_record(cfg, _split_batch(plan.batch), key, build, depths[0])]


def other_engine_records(cfg, plan, config: Mapping, build: Callable, engine: str,
                         zero_stage: int) -> list[dict]:
    """The records of ``engine`` (the other engine, built by ``build``) at the job's layout and
    ``zero_stage``, at the smallest depth, with the job's micro-batches and in micro-batches of
    one sample: its framework cost per step and per micro-batch, which a layout of that engine
    planned from this probe carries (without them a Megatron-Core probe planned DeepSpeed with
    none: up to 37% under its runs on the EPYC here)."""
    depth = engine_depths(cfg.model.num_layers, plan.dims)[0]
    key = {**engine_key(plan.to_dict(), config), "engine": engine, "zero_stage": zero_stage}
    return [_engine_record(cfg, b, key, build, depth)
            for b in (plan.batch, _split_batch(plan.batch))]


def engine_depths(num_layers: int, dims) -> list[int]:
    """Layers the engine runs are built with: :data:`ENGINE_DEPTHS` per model chunk, capped by
    the model's depth."""
    chunks = dims.pp * dims.vpp
    return sorted({chunks * min(d, max(1, num_layers // chunks)) for d in ENGINE_DEPTHS})


def _split_batch(b):
    """The batch ``b`` in micro-batches of one sample (the same samples a step; twice the
    micro-batches when they already hold one): the framework's cost per micro-batch is the
    difference from ``b`` beyond the composed passes, measured where it weighs most (the
    search's small micro-batches)."""
    accum = b.grad_accum_steps * (b.micro_batch_size if b.micro_batch_size > 1 else 2)
    return dataclasses.replace(b, micro_batch_size=1, grad_accum_steps=accum,
                               global_batch_size=accum * b.data_parallel_size)


def _engine_record(cfg, b, key: dict, build: Callable, layers: int) -> dict:
    """One engine run: ``build`` at ``layers`` layers and batch ``b``, its median step (the
    slowest rank's)."""
    from launcher.engines.probe.passes import synthetic_batch

    batch = synthetic_batch(b.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size)
    step = _step_seconds(build(dataclasses.replace(cfg.model, num_layers=layers), b), batch)
    return {"key": {**key, "micro_batch": b.micro_batch_size, "grad_accum": b.grad_accum_steps},
            "layers": layers, "seconds": collectives.max_floats([step])[0]}


def _step_seconds(engine, batch: dict) -> float:
    """Median seconds of one training step of ``engine`` on ``batch`` (the ranks lined up)."""
    from launcher.core.phases import PhaseTimer
    from launcher.engines.probe.passes import compute_device
    from launcher.parallel.timing import median_seconds

    return median_seconds(lambda: engine.train_step(lambda: dict(batch), 1e-5, PhaseTimer()),
                          reps=ENGINE_REPS, warmup=ENGINE_WARM_STEPS, device=compute_device(),
                          before=collectives.barrier)
