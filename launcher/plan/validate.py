"""Checks of a composed config, split by concern. Each returns every problem it finds.

A problem names the keys involved, their values and a fix. ``launcher.plan`` runs them all before
deriving anything, so a user sees every mistake at once, before any process is spawned.
"""

from __future__ import annotations

import dataclasses
import math
import signal
from pathlib import PurePath

from launcher.config import (Activation, Arch, AttentionBackend, DataFormat, HfFamily,
                             ModelConfig, NormPlacement, TrainwrightConfig, compute_precision)
from launcher.core.problems import Problem, divisors, fmt_values
from launcher.core.stop import resolve_signal
from launcher.engines import spec
from launcher.plan.data_check import chat_pack_multiples, chat_seq_lengths, loss_mask_shards
from launcher.plan.kubernetes import kubernetes_problems
from launcher.plan.validate_layers import check_layer_features
from launcher.shape.dims import ParallelDims
from launcher.shape.model import ResolvedModel
from launcher.shape.stages import KEYS as SPLIT_KEYS, StageSplit, split_problems


def _not_divisible(key: str, value: int, by_key: str, by: int, fix_key: str | None = None) -> Problem:
    """'<key>=v is not divisible by <by_key>=b; use one of <divisors of v>' (for fix_key)."""
    fix_key = fix_key or by_key
    return Problem((key, by_key), f"{key}={value} is not divisible by {by_key}={by}; "
                                  f"use {fix_key} from {fmt_values(divisors(value))}")


def check_positive(cfg: TrainwrightConfig) -> list[Problem]:
    values = {
        "model.num_layers": cfg.model.num_layers, "model.hidden_size": cfg.model.hidden_size,
        "model.ffn_hidden_size": cfg.model.ffn_hidden_size,
        "model.num_attention_heads": cfg.model.num_attention_heads,
        "model.vocab_size": cfg.model.vocab_size, "model.seq_length": cfg.model.seq_length,
        "cluster.nodes": cfg.cluster.nodes, "cluster.gpus_per_node": cfg.cluster.gpus_per_node,
        "cluster.ranks_per_gpu": cfg.cluster.ranks_per_gpu,
        "trainer.micro_batch_size": cfg.trainer.micro_batch_size,
        **{f"parallelism.{k}": getattr(cfg.parallelism, k) for k in (
            "tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_parallel_size",
            "context_parallel_size", "expert_parallel_size")},
    }
    problems = [Problem((k,), f"{k}={v} must be a positive integer") for k, v in values.items()
                if v < 1]
    for key in ("model.num_query_groups", "model.kv_channels", "model.num_experts",
                "model.window_size", "model.full_attention_every", "model.rotary_base_local",
                "model.softmax_scale_dim", "trainer.global_batch_size", "trainer.train_tokens",
                "trainer.train_steps"):
        group, name = key.split(".")
        if getattr(getattr(cfg, group), name) < 0:
            problems.append(Problem((key,), f"{key} must be >= 0 (0 means derived/unset)"))
    if not 0 <= cfg.plan.mfu <= 1:
        problems.append(Problem(("plan.mfu",), f"plan.mfu={cfg.plan.mfu} must be in (0, 1] "
                                               "(0.3-0.5 is typical for dense LLMs on H100), or "
                                               "0 for the step-time model (the default)"))
    return problems


UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)
"""Signals no handler can see."""

NAN_POLICIES = ("abort", "skip")
"""Values of trainer.nan_policy."""


def check_values(cfg: TrainwrightConfig) -> list[Problem]:
    """Values that would otherwise fail inside the training processes, after launch."""
    o, t = cfg.optimizer, cfg.trainer
    problems = []
    for key, value in (("optimizer.lr", o.lr), ("optimizer.min_lr", o.min_lr)):
        if not math.isfinite(value) or value < 0 or (key == "optimizer.lr" and value == 0):
            problems.append(Problem((key,), f"{key}={value} must be a finite number > 0 "
                                            "(min_lr may be 0), e.g. optimizer.lr=3e-4"))
    for key in ("checkpoint_gbps_per_node", "store_gbps_per_node"):
        value = getattr(cfg.cluster, key)
        if not math.isfinite(value) or value <= 0:
            problems.append(Problem((f"cluster.{key}",), f"cluster.{key}={value} must be a "
                                    f"rate > 0 in GB/s, e.g. cluster.{key}=1.0"))
    for key, value in (("trainer.log_interval", t.log_interval),):
        if value < 1:
            problems.append(Problem((key,), f"{key}={value} must be >= 1 (optimizer steps "
                                            "between metric lines), e.g. trainer.log_interval=1"))
    if t.nan_policy not in NAN_POLICIES:
        problems.append(Problem(("trainer.nan_policy",), f"trainer.nan_policy={t.nan_policy!r} "
                                f"is not one of {', '.join(NAN_POLICIES)}"))
    return problems + _check_stop_signal(t.stop_signal) + _check_run_name(cfg.run.name) \
        + _check_loss_fusion(t) + _check_checkpoint_store(t)


def _check_checkpoint_store(t) -> list[Problem]:
    """trainer.checkpoint_uri: a local path or s3://bucket/prefix (other schemes are not
    stores we speak to; a path with '://' is almost surely one)."""
    problems = []
    for key, value in (("trainer.checkpoint_uri", t.checkpoint_uri), ("trainer.load", t.load)):
        if "://" in value and not value.startswith("s3://"):
            problems.append(Problem((key,), f"{key}={value!r}: only s3:// object storage "
                                    "(any S3-API store: AWS, GCS's XML API, MinIO, SeaweedFS, "
                                    "...) or a local path is supported"))
        elif value.startswith("s3://"):
            bucket = value[5:].partition("/")[0]
            if not 3 <= len(bucket) <= 63:
                problems.append(Problem((key,), f"{key}={value!r} names no valid bucket "
                                        "(s3://<bucket of 3-63 characters>/<prefix>)"))
    for key in ("trainer.checkpoint_retry_s", "trainer.checkpoint_failures_allowed"):
        if getattr(t, key.split(".")[1]) < 0:
            problems.append(Problem((key,), f"{key} must be >= 0 (0 means derived/never)"))
    return problems


def _check_loss_fusion(t) -> list[Problem]:
    """Megatron-Core's fused cross-entropy returns bf16 logit gradients (megatron-core 0.16.1
    ``fused_cross_entropy.calculate_gradients``), wrong for fp32 and fp16 training; TE's is run
    and planned here in bf16 only (not tried in other precisions)."""
    choice, precision = t.cross_entropy_fusion, t.precision
    if choice in ("te", "native") and compute_precision(precision) != "bf16":
        return [Problem(("trainer.cross_entropy_fusion", "trainer.precision"),
                        f"trainer.cross_entropy_fusion={choice} needs trainer.precision=bf16 "
                        f"(the fused kernels return bf16 logit gradients; this run is "
                        f"{precision}); use trainer.cross_entropy_fusion=auto or off")]
    return []


def _check_stop_signal(name: str) -> list[Problem]:
    """trainer.stop_signal must name a signal a process can catch."""
    key = "trainer.stop_signal"
    try:
        sig = resolve_signal(name)
    except ValueError as exc:
        return [Problem((key,), str(exc))]
    if sig in UNCATCHABLE:
        return [Problem((key,), f"{key}={name} cannot be caught by a process, so no checkpoint "
                                "could be saved; use SIGUSR1 (the default) or SIGUSR2")]
    return []


def names_a_run_dir(name: str) -> bool:
    """Whether ``name`` is a directory strictly inside run.output_root: relative, no '..', and
    not the output root itself ('.')."""
    path = PurePath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts \
        and name.strip("/") not in (".", "")


def _check_run_name(name: str) -> list[Problem]:
    """run.name is one directory inside run.output_root ('' = <model>_<cluster>)."""
    if name and not names_a_run_dir(name):
        return [Problem(("run.name",), f"run.name={name!r} must name a directory inside "
                                       "run.output_root (no leading '/', no '..', not '.'), "
                                       "e.g. run.name=my_run")]
    return []


def check_model_shapes(cfg: TrainwrightConfig, dims: ParallelDims) -> list[Problem]:
    """Heads, groups, widths, layers, sequence and experts split evenly over their groups;
    multi-latent attention and the MoE router and layout (launcher.plan.validate_layers)."""
    m = cfg.model
    tp, cp, ep = dims.tp, dims.cp, dims.ep
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
    problems += split_problems(m.num_layers, dims.pp, dims.vpp, dims.split)
    if cp > 1 and m.seq_length % (2 * cp):
        problems.append(Problem(
            ("model.seq_length", "parallelism.context_parallel_size"),
            f"model.seq_length={m.seq_length} is not divisible by 2 x context_parallel_size = "
            f"{2 * cp} (each CP rank takes two balanced chunks); use context_parallel_size with "
            f"2 x CP from {fmt_values(divisors(m.seq_length))}"))
    problems += _check_experts(m.num_experts, ep) + _check_expert_bias(m, tp)
    problems += check_layer_features(m, tp)
    return (problems + _check_window(cfg, cp) + _check_norms(m) + _check_local_layers(cfg)
            + _check_hf_family(m))


def _check_hf_family(m: ModelConfig) -> list[Problem]:
    """A model.hf_family set by hand that cannot hold the model (its weights could not be
    named in that family, nor exported): refused before the run, not at its export."""
    if m.hf_family == HfFamily.auto:
        return []
    from launcher.engines.weights.hf_export import export_problems  # torch-free

    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
    return [Problem(("model.hf_family",), (
        f"{line}; set model.hf_family=auto or change the model"))
        for line in export_problems(fields)]


def _check_local_layers(cfg: TrainwrightConfig) -> list[Problem]:
    """Flash attention asked for a model built from rewritten local layers (OLMo 2, Gemma 3),
    whose attention is Megatron-Core's unfused one."""
    if cfg.trainer.attention_backend != AttentionBackend.flash:
        return []
    if not ResolvedModel.of(cfg.model).local_layers:
        return []
    return [Problem(("trainer.attention_backend", "model.norm_placement"), (
        "trainer.attention_backend=flash: this model's layers (model.norm_placement="
        f"{cfg.model.norm_placement}, norm_zero_centered={cfg.model.norm_zero_centered}, "
        f"qk_layernorm_all_heads={cfg.model.qk_layernorm_all_heads}, rotary_base_local="
        f"{cfg.model.rotary_base_local}) are built from Megatron-Core's local layers, whose "
        "attention is unfused; set trainer.attention_backend=auto"))]


def _check_norms(m: ModelConfig) -> list[Problem]:
    """OLMo 2's layer (norms after attention and MLP, QK norms over all heads) as built here: a
    dense Llama layer without biases. (Key norms over all heads need each rank's own key heads:
    num_query_groups divisible by TP, checked above.)"""
    problems = []
    if m.norm_placement != NormPlacement.pre:
        for key, bad, why in (("model.arch", m.arch != Arch.llama, f"arch={m.arch}"),
                              ("model.num_experts", m.num_experts > 0,
                               f"num_experts={m.num_experts}"),
                              ("model.add_bias_linear", m.add_bias_linear, "add_bias_linear=true")):
            if bad:
                problems.append(Problem(("model.norm_placement", key), (
                    f"model.norm_placement={m.norm_placement} is built for a dense Llama layer "
                    f"without biases, not with model.{why}; set model.norm_placement=pre or "
                    f"change {key}")))
    if m.norm_zero_centered and m.arch != Arch.llama:
        problems.append(Problem(("model.norm_zero_centered", "model.arch"), (
            f"model.norm_zero_centered=true is an RMSNorm (arch=llama), not arch={m.arch}'s "
            "LayerNorm; set model.norm_zero_centered=false")))
    if m.arch == Arch.llama and m.activation == Activation.gelu:
        problems.append(Problem(("model.activation", "model.arch"), (
            "model.activation=gelu with model.arch=llama: a llama MLP is gated, SwiGLU "
            "(activation=auto) or GeGLU with tanh GeLU (activation=gelu_tanh); set one of them")))
    if m.qk_layernorm_all_heads and not m.qk_layernorm:
        problems.append(Problem(("model.qk_layernorm_all_heads", "model.qk_layernorm"), (
            "model.qk_layernorm_all_heads=true says how the query and key norms run, but "
            "model.qk_layernorm=false has none; set model.qk_layernorm=true or drop it")))
    return problems


def _needs_window(m: ModelConfig) -> list[Problem]:
    """Settings of the windowed layers, given without a window."""
    return [Problem((key, "model.window_size"), (
        f"{key}={value} sets the sliding-window layers apart, but model.window_size=0 makes "
        f"none; set model.window_size or {key}=0"))
        for key, value in (("model.full_attention_every", m.full_attention_every),
                           ("model.rotary_base_local", m.rotary_base_local))
        if value > 0 and not m.window_size]


def _check_window(cfg: TrainwrightConfig, cp: int) -> list[Problem]:
    """Sliding-window attention (model.window_size) with what it is not built for here: packed
    chat rows under Transformer Engine (unchecked; the local attention combines the window with
    the rows' mask, launcher/engines/layer_spec.py), and context parallelism's ring."""
    window = cfg.model.window_size
    if not window:
        return _needs_window(cfg.model)
    problems = []
    te = str(cfg.cluster.gpu).lower() != "cpu" and not ResolvedModel.of(cfg.model).local_layers
    if cfg.data.format == DataFormat.chat and te:
        problems.append(Problem(("model.window_size", "data.format", "cluster.gpu"), (
            f"model.window_size={window} with data.format=chat on cluster.gpu={cfg.cluster.gpu}: "
            "the packed rows go to Transformer Engine's attention as THD sequences, and a window "
            "over them has not been checked on a GPU here (on CPU the local attention combines "
            "the window with the rows' mask); train with full attention (model.window_size=0), "
            "on text, or on CPU")))
    if cp > 1:
        problems.append(Problem(("model.window_size", "parallelism.context_parallel_size"), (
            f"model.window_size={window} with context_parallel_size={cp}: the window is not "
            "applied across context-parallel chunks here; set context_parallel_size=1")))
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


def _check_expert_bias(m: ModelConfig, tp: int) -> list[Problem]:
    """Megatron-Core (0.16) asserts "Bias in Moe is only supported when ETP==1" when it builds the
    TransformerConfig; the expert tensor-parallel size is the tensor-parallel size here."""
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
            f" = {per_step}; use a multiple of {per_step} ({fmt_values(options, 4)}, ...) or a "
            f"micro_batch_size from {fmt_values(_batch_options(t.global_batch_size, data_parallel_size))}"))
    if bool(t.train_tokens) == bool(t.train_steps):
        problems.append(Problem(
            ("trainer.train_tokens", "trainer.train_steps"),
            f"set exactly one of trainer.train_tokens={t.train_tokens} and trainer.train_steps="
            f"{t.train_steps} (the other is derived); e.g. trainer.train_steps=0"))
    return problems


def schedule_warnings(cfg: TrainwrightConfig, train_steps: int) -> list[str]:
    """What about the learning-rate schedule deserves a word but not a refusal (a smoke run of a
    few steps with the default warmup is legitimate)."""
    o = cfg.optimizer
    if o.warmup_steps >= train_steps:
        return [f"optimizer.warmup_steps={o.warmup_steps} is not below the {train_steps} "
                f"optimizer steps of the run (trainer.train_steps/train_tokens): the lr never "
                f"reaches optimizer.lr={o.lr}; set e.g. optimizer.warmup_steps="
                f"{max(0, train_steps // 10)} for a full schedule"]
    return []


def _batch_options(global_batch: int, dp: int) -> list[int]:
    return [m for m in divisors(global_batch) if global_batch % (m * dp) == 0]


def check_engine(cfg: TrainwrightConfig) -> list[Problem]:
    """The ZeRO stage range, then what the chosen engine refuses (its spec's problems, from the
    registry), each with the setting that works."""
    p = cfg.parallelism
    problems = []
    if not 0 <= p.zero_stage <= 3:
        problems.append(Problem(("parallelism.zero_stage",),
                                f"parallelism.zero_stage={p.zero_stage} must be 0, 1, 2 or 3"))
    split = StageSplit.of(p)
    if split.uneven and cfg.engine.name.value != "megatron":
        problems.append(Problem(
            SPLIT_KEYS + ("engine",),
            f"{' '.join(split.overrides())} needs engine=megatron (uneven pipeline stages are "
            f"Megatron-Core's; engine={cfg.engine.name.value} has no pipeline stages); use "
            "engine=megatron or leave the stage split even"))
    return problems + [Problem(tuple(e.keys), e.message)
                       for e in spec(cfg.engine.name).problems(cfg)]


LAUNCHERS = ("local", "slurm", "kubernetes")


def check_cluster(cfg: TrainwrightConfig) -> list[Problem]:
    """A known launcher; several ranks per GPU only on the local launcher; a Kubernetes
    cluster's own checks (launcher.plan.kubernetes)."""
    c = cfg.cluster
    if c.launcher not in LAUNCHERS:
        return [Problem(("cluster.launcher",), (
            f"cluster.launcher={c.launcher!r} is not a launcher; use one of "
            f"{', '.join(LAUNCHERS)}"))]
    problems = kubernetes_problems(c, cfg.run, cfg.trainer.checkpoint_uri)
    if c.ranks_per_gpu > 1 and c.launcher != "local":
        problems.append(Problem(
            ("cluster.ranks_per_gpu", "cluster.launcher"),
            f"cluster.ranks_per_gpu={c.ranks_per_gpu} with cluster.launcher={c.launcher}: several "
            "training processes per GPU is a development feature of the local launcher "
            "(python -m launcher.train on one machine); set cluster.ranks_per_gpu=1 for a "
            f"{c.launcher.capitalize()} job, or run locally (e.g. cluster=local_gpu)"))
    return problems


def check_static(cfg: TrainwrightConfig, dims: ParallelDims) -> list[Problem]:
    """Every check that needs no derived numbers beyond the layout ``dims`` (built once
    check_positive has passed; its own problems come first)."""
    return (dims.problems(cfg.cluster, moe=bool(cfg.model.num_experts))
            + check_model_shapes(cfg, dims) + check_engine(cfg) + check_cluster(cfg)
            + check_data_format(cfg))


def check_data_format(cfg: TrainwrightConfig) -> list[Problem]:
    """data.format=chat (packed conversations, a loss mask) trains on engine=megatron only, from
    shards (no mock data)."""
    if cfg.data.format == DataFormat.text:
        problems = chat_shards_as_text_problems(cfg.data.prefixes)
        if cfg.trainer.per_token_loss and cfg.engine.name.value != "megatron":
            problems.append(Problem(("trainer.per_token_loss", "engine.name"), (
                "trainer.per_token_loss=true is Megatron-Core's calculate_per_token_loss; "
                "set engine=megatron, or trainer.per_token_loss=null")))
        return problems
    problems = chat_shard_problems(cfg.data.prefixes, cfg.model.seq_length)
    if cfg.engine.name.value != "megatron":
        problems.append(Problem(("data.format", "engine.name"), (
            f"data.format=chat on engine={cfg.engine.name.value}: packed conversations need "
            "attention cut at their boundaries and a loss summed per target token over the "
            "global batch, which trainwright builds on Megatron-Core only; set engine=megatron")))
    if not cfg.data.prefixes:
        problems.append(Problem(("data.format", "data.prefixes"), (
            "data.format=chat needs the shards of data_prep format=chat in data.prefixes "
            "(data=<the name data_prep wrote>); mock data has no conversations")))
    return problems + chat_context_parallel_problems(cfg.data.prefixes,
                                                     cfg.parallelism.context_parallel_size)


def chat_shards_as_text_problems(prefixes) -> list[Problem]:
    """Chat shards (a loss mask beside the tokens) read as text would train on every token,
    prompts and template included, across conversations: refused."""
    return [Problem(("data.format", "data.prefixes"), (
        f"data.format=text, but {prefix} holds data_prep format=chat shards (packed "
        f"conversations with their loss mask {prefix}.mask.bin), which text training would "
        "read as plain documents; set data.format=chat (the data.yaml data_prep wrote beside "
        "the shards says so: data=<its name>)"))
        for prefix, masked in loss_mask_shards(prefixes).items() if masked]


def chat_shard_problems(prefixes, seq_length: int) -> list[Problem]:
    """Shards without a loss mask, and rows packed for another sequence length (longer ones do
    not fit; shorter ones leave the rest of every row padding)."""
    problems = [Problem(("data.format", "data.prefixes"), (
        f"data.format=chat, but {prefix} has no loss mask ({prefix}.mask.bin/.idx): it is not "
        "the output of data_prep format=chat; prepare the conversations with python -m "
        "data_prep format=chat, or set data.format=text for plain documents"))
        for prefix, masked in loss_mask_shards(prefixes).items() if not masked]
    return problems + [Problem(("model.seq_length", "data.prefixes"), (
        f"model.seq_length={seq_length}, but {path} was packed into rows for seq_length={packed} "
        f"({packed + 1} tokens a row); re-run data_prep format=chat with seq_length={seq_length}, "
        f"or set model.seq_length={packed}"))
        for path, packed in chat_seq_lengths(prefixes).items() if packed != seq_length]


def chat_context_parallel_problems(prefixes, cp: int) -> list[Problem]:
    """Context parallelism splits every packed conversation into 2 x CP chunks, so each must
    have room in its row to be padded to a multiple of that: the shards must have been packed
    at a chat.pack_multiple that 2 x CP divides."""
    if cp == 1:
        return []
    wrong = {path: m for path, m in chat_pack_multiples(prefixes).items() if m % (2 * cp)}
    return [Problem(("parallelism.context_parallel_size", "data.prefixes"), (
        f"parallelism.context_parallel_size={cp} splits each packed conversation into 2 x CP = "
        f"{2 * cp} chunks, but {path} was packed at chat.pack_multiple={m}, which leaves no "
        f"room to pad conversations to a multiple of {2 * cp}; re-run data_prep format=chat "
        f"with chat.pack_multiple={2 * cp} (or a multiple of it)"))
        for path, m in wrong.items()]


def check_interleaving(dims: ParallelDims, grad_accum: int) -> list[Problem]:
    """Megatron-Core's interleaved schedule runs micro-batches in groups of PP: it refuses fewer
    than PP of them and a remainder (``microbatch_group_size_per_vp_stage``, schedules.py).
    The plan reports it as a warning (a model is still built and planned); the search drops
    such layouts."""
    if dims.vpp == 1 or grad_accum % dims.pp == 0:
        return []
    return [Problem(
        ("parallelism.virtual_pipeline_parallel_size", "trainer.global_batch_size",
         "trainer.micro_batch_size"),
        f"virtual_pipeline_parallel_size={dims.vpp} (interleaved schedule) needs the micro-batches "
        f"per step, global batch / (micro_batch_size x data-parallel size) = {grad_accum}, to be "
        f"a multiple of pipeline_parallel_size={dims.pp}; raise trainer.global_batch_size to a "
        f"multiple of {dims.pp} x micro_batch_size x DP, or set virtual_pipeline_parallel_size=1")]
