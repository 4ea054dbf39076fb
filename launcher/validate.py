"""Checks of a composed config, split by concern. Each returns every problem it finds.

A problem names the keys involved, their values and a fix. ``launcher.plan`` runs them all before
deriving anything, so a user sees every mistake at once, before any process is spawned.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import EngineName, TrainwrightConfig


@dataclass(frozen=True)
class Problem:
    keys: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return self.message


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0] if n > 0 else []


def _fmt(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (", ..." if len(values) > limit else "")


def _not_divisible(key: str, value: int, by_key: str, by: int, fix_key: str | None = None) -> Problem:
    """'<key>=v is not divisible by <by_key>=b; use one of <divisors of v>' (for fix_key)."""
    fix_key = fix_key or by_key
    return Problem((key, by_key), f"{key}={value} is not divisible by {by_key}={by}; "
                                  f"use {fix_key} from {_fmt(divisors(value))}")


def check_positive(cfg: TrainwrightConfig) -> list[Problem]:
    values = {
        "model.num_layers": cfg.model.num_layers, "model.hidden_size": cfg.model.hidden_size,
        "model.ffn_hidden_size": cfg.model.ffn_hidden_size,
        "model.num_attention_heads": cfg.model.num_attention_heads,
        "model.vocab_size": cfg.model.vocab_size, "model.seq_length": cfg.model.seq_length,
        "cluster.nodes": cfg.cluster.nodes, "cluster.gpus_per_node": cfg.cluster.gpus_per_node,
        "trainer.micro_batch_size": cfg.trainer.micro_batch_size,
        **{f"parallelism.{k}": getattr(cfg.parallelism, k) for k in (
            "tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_parallel_size",
            "context_parallel_size", "expert_parallel_size")},
    }
    problems = [Problem((k,), f"{k}={v} must be a positive integer") for k, v in values.items()
                if v < 1]
    for key in ("model.num_query_groups", "model.kv_channels", "model.num_experts",
                "trainer.global_batch_size", "trainer.train_tokens", "trainer.train_steps"):
        group, name = key.split(".")
        if getattr(getattr(cfg, group), name) < 0:
            problems.append(Problem((key,), f"{key} must be >= 0 (0 means derived/unset)"))
    if not 0 < cfg.plan.mfu <= 1:
        problems.append(Problem(("plan.mfu",), f"plan.mfu={cfg.plan.mfu} must be in (0, 1]; "
                                               "0.3-0.5 is typical for dense LLMs on H100"))
    return problems


def check_layout(cfg: TrainwrightConfig, world_size: int) -> list[Problem]:
    """The world splits into TP x PP x CP model replicas (and TP x EP x PP for experts)."""
    p = cfg.parallelism
    tp, pp, cp, ep = (p.tensor_parallel_size, p.pipeline_parallel_size,
                      p.context_parallel_size, p.expert_parallel_size)
    world = (f"world size {world_size} (cluster.nodes={cfg.cluster.nodes} x "
             f"cluster.gpus_per_node={cfg.cluster.gpus_per_node})")
    problems = []
    if world_size % (tp * pp * cp):
        problems.append(Problem(
            ("cluster.nodes", "cluster.gpus_per_node", "parallelism.tensor_parallel_size",
             "parallelism.pipeline_parallel_size", "parallelism.context_parallel_size"),
            f"{world} is not a multiple of TP x PP x CP = {tp * pp * cp} "
            f"(tensor_parallel_size={tp}, pipeline_parallel_size={pp}, context_parallel_size={cp});"
            f" use a world size that is a multiple of {tp * pp * cp}, or TP x PP x CP from "
            f"{_fmt(divisors(world_size))}"))
    if cfg.model.num_experts and world_size % (tp * ep * pp):
        problems.append(Problem(
            ("parallelism.expert_parallel_size", "parallelism.tensor_parallel_size"),
            f"{world} is not a multiple of TP x EP x PP = {tp * ep * pp} (tensor_parallel_size="
            f"{tp}, expert_parallel_size={ep}, pipeline_parallel_size={pp}); choose EP so that "
            f"TP x EP x PP divides {world_size}"))
    if p.sequence_parallel and tp == 1:
        problems.append(Problem(
            ("parallelism.sequence_parallel", "parallelism.tensor_parallel_size"),
            "parallelism.sequence_parallel=true needs tensor_parallel_size > 1 (it shards along "
            "the TP group); set parallelism.sequence_parallel=false or raise tensor_parallel_size"))
    if p.virtual_pipeline_parallel_size > 1 and pp == 1:
        problems.append(Problem(
            ("parallelism.virtual_pipeline_parallel_size", "parallelism.pipeline_parallel_size"),
            f"parallelism.virtual_pipeline_parallel_size={p.virtual_pipeline_parallel_size} needs "
            "pipeline_parallel_size > 1; set virtual_pipeline_parallel_size=1"))
    return problems


def check_model_shapes(cfg: TrainwrightConfig) -> list[Problem]:
    """Heads, groups, widths, layers, sequence and experts split evenly over their groups."""
    m, p = cfg.model, cfg.parallelism
    tp, cp, ep = p.tensor_parallel_size, p.context_parallel_size, p.expert_parallel_size
    groups = m.num_query_groups or m.num_attention_heads
    tp_key = "parallelism.tensor_parallel_size"
    problems = []
    if m.num_attention_heads % tp:
        problems.append(_not_divisible("model.num_attention_heads", m.num_attention_heads,
                                       tp_key, tp))
    if groups % tp:
        problems.append(_not_divisible("model.num_query_groups", groups, tp_key, tp))
    if m.num_attention_heads % groups:
        problems.append(_not_divisible("model.num_attention_heads", m.num_attention_heads,
                                       "model.num_query_groups", groups))
    if not m.kv_channels and m.hidden_size % m.num_attention_heads:
        problems.append(_not_divisible("model.hidden_size", m.hidden_size,
                                       "model.num_attention_heads", m.num_attention_heads))
    ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size if m.num_experts else m.ffn_hidden_size
    if ffn % tp:
        problems.append(_not_divisible("model.ffn_hidden_size", ffn, tp_key, tp))
    stages = p.pipeline_parallel_size * p.virtual_pipeline_parallel_size
    if m.num_layers % stages:
        problems.append(Problem(
            ("model.num_layers", "parallelism.pipeline_parallel_size",
             "parallelism.virtual_pipeline_parallel_size"),
            f"model.num_layers={m.num_layers} is not divisible by pipeline_parallel_size x "
            f"virtual_pipeline_parallel_size = {p.pipeline_parallel_size} x "
            f"{p.virtual_pipeline_parallel_size} = {stages}; use a product from "
            f"{_fmt(divisors(m.num_layers))}"))
    if cp > 1 and m.seq_length % (2 * cp):
        problems.append(Problem(
            ("model.seq_length", "parallelism.context_parallel_size"),
            f"model.seq_length={m.seq_length} is not divisible by 2 x context_parallel_size = "
            f"{2 * cp} (each CP rank takes two balanced chunks); use context_parallel_size with "
            f"2 x CP from {_fmt(divisors(m.seq_length))}"))
    problems += _check_experts(m.num_experts, ep) + _check_expert_bias(cfg)
    return problems


def _check_experts(experts: int, ep: int) -> list[Problem]:
    if ep > 1 and not experts:
        return [Problem(("parallelism.expert_parallel_size", "model.num_experts"),
                        f"parallelism.expert_parallel_size={ep} needs a mixture-of-experts model "
                        "(model.num_experts > 0); set expert_parallel_size=1")]
    if experts and experts % ep:
        return [_not_divisible("model.num_experts", experts,
                               "parallelism.expert_parallel_size", ep)]
    return []


def _check_expert_bias(cfg: TrainwrightConfig) -> list[Problem]:
    """Megatron-Core (0.16) asserts "Bias in Moe is only supported when ETP==1" when it builds the
    TransformerConfig; the expert tensor-parallel size is the tensor-parallel size here."""
    m, tp = cfg.model, cfg.parallelism.tensor_parallel_size
    if m.num_experts and m.add_bias_linear and tp > 1:
        return [Problem(
            ("model.add_bias_linear", "model.num_experts", "parallelism.tensor_parallel_size"),
            f"model.add_bias_linear=true with a mixture-of-experts model (model.num_experts="
            f"{m.num_experts}) needs parallelism.tensor_parallel_size=1, got {tp} (Megatron-Core "
            "supports expert biases only at expert tensor-parallel size 1, which equals "
            "tensor_parallel_size here); set model.add_bias_linear=false or "
            "parallelism.tensor_parallel_size=1")]
    return []


def check_batch(cfg: TrainwrightConfig, data_parallel_size: int) -> list[Problem]:
    t = cfg.trainer
    problems = []
    per_step = t.micro_batch_size * data_parallel_size
    if t.global_batch_size and t.global_batch_size % per_step:
        options = [per_step * k for k in range(1, 5)]
        problems.append(Problem(
            ("trainer.global_batch_size", "trainer.micro_batch_size"),
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
            f"micro_batch_size x data-parallel size = {t.micro_batch_size} x {data_parallel_size}"
            f" = {per_step}; use a multiple of {per_step} ({_fmt(options, 4)}, ...) or a "
            f"micro_batch_size from {_fmt(_batch_options(t.global_batch_size, data_parallel_size))}"))
    if bool(t.train_tokens) == bool(t.train_steps):
        problems.append(Problem(
            ("trainer.train_tokens", "trainer.train_steps"),
            f"set exactly one of trainer.train_tokens={t.train_tokens} and trainer.train_steps="
            f"{t.train_steps} (the other is derived); e.g. trainer.train_steps=0"))
    return problems


def check_schedule(cfg: TrainwrightConfig, train_steps: int) -> list[Problem]:
    """The learning-rate schedule fits in the step budget."""
    o = cfg.optimizer
    if o.warmup_steps >= train_steps:
        return [Problem(("optimizer.warmup_steps", "trainer.train_steps"),
                        f"optimizer.warmup_steps={o.warmup_steps} is not below the {train_steps} "
                        f"optimizer steps of the run (trainer.train_steps/train_tokens); the lr "
                        f"would never reach optimizer.lr={o.lr}; use warmup_steps < {train_steps}, "
                        f"e.g. optimizer.warmup_steps={max(0, train_steps // 10)}")]
    return []


def _batch_options(global_batch: int, dp: int) -> list[int]:
    return [m for m in divisors(global_batch) if global_batch % (m * dp) == 0]


def check_engine(cfg: TrainwrightConfig) -> list[Problem]:
    """Combinations the chosen engine cannot run, with the setting that can."""
    p, engine = cfg.parallelism, cfg.engine.name
    problems = []
    if not 0 <= p.zero_stage <= 3:
        problems.append(Problem(("parallelism.zero_stage",),
                                f"parallelism.zero_stage={p.zero_stage} must be 0, 1, 2 or 3"))
    if engine == EngineName.deepspeed:
        if p.pipeline_parallel_size > 1 and p.zero_stage >= 2:
            problems.append(Problem(
                ("parallelism.zero_stage", "parallelism.pipeline_parallel_size", "engine"),
                f"parallelism.zero_stage={p.zero_stage} with pipeline_parallel_size="
                f"{p.pipeline_parallel_size} is not supported by DeepSpeed (ZeRO 2/3 shard "
                "gradients that pipeline stages accumulate across micro-batches, and "
                "trainwright's DeepSpeed path does not pipeline); pipeline_parallel_size="
                f"{p.pipeline_parallel_size} with zero_stage={p.zero_stage} needs "
                "engine=megatron with the distributed optimizer (parallelism.zero_stage=1)"))
        problems += _deepspeed_layouts(p)
        if cfg.trainer.async_save:
            problems.append(Problem(
                ("trainer.async_save", "engine"),
                "trainer.async_save=true needs engine=megatron (Megatron-Core "
                "dist-checkpointing); DeepSpeed saves synchronously: set "
                "trainer.async_save=false or engine=megatron"))
        if p.offload_params and p.zero_stage != 3:
            problems.append(Problem(
                ("parallelism.offload_params", "parallelism.zero_stage"),
                f"parallelism.offload_params=true needs zero_stage=3 (got {p.zero_stage}); set "
                "parallelism.zero_stage=3 or parallelism.offload_params=false"))
    else:
        if p.zero_stage >= 2:
            problems.append(Problem(
                ("parallelism.zero_stage", "engine"),
                f"engine=megatron supports parallelism.zero_stage 0 (DDP) or 1 (distributed "
                f"optimizer, ZeRO-1), got {p.zero_stage}; set parallelism.zero_stage=1, or use "
                "engine=deepspeed for ZeRO 2/3 (without pipeline parallelism)"))
        if p.offload_optimizer or p.offload_params:
            problems.append(Problem(
                ("parallelism.offload_optimizer", "parallelism.offload_params", "engine"),
                "CPU offload (parallelism.offload_optimizer/offload_params) is a DeepSpeed "
                "feature; use engine=deepspeed or set both to false"))
    return problems


def _deepspeed_layouts(p) -> list[Problem]:
    """Virtual pipeline, context and expert parallelism need Megatron-Core's DDP and schedules.

    So do pipeline stages: trainwright's DeepSpeed path does not pipeline (ZeRO 2/3 with
    stages has its own message above)."""
    sizes = {"pipeline_parallel_size": p.pipeline_parallel_size if p.zero_stage < 2 else 1,
             "virtual_pipeline_parallel_size": p.virtual_pipeline_parallel_size,
             "context_parallel_size": p.context_parallel_size,
             "expert_parallel_size": p.expert_parallel_size}
    return [Problem((f"parallelism.{key}", "engine"),
                    f"parallelism.{key}={value} is not supported by engine=deepspeed (trainwright's "
                    "DeepSpeed path has no Megatron-Core schedule or expert/context-parallel "
                    f"gradient groups); use engine=megatron, or set parallelism.{key}=1")
            for key, value in sizes.items() if value > 1]


def check_static(cfg: TrainwrightConfig, world_size: int) -> list[Problem]:
    """Every check that needs no derived numbers."""
    problems = check_positive(cfg)
    if problems:  # divisibility checks would divide by zero
        return problems
    return (check_layout(cfg, world_size) + check_model_shapes(cfg) + check_engine(cfg))
