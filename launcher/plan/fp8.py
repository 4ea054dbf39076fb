"""FP8 training (``trainer.precision=fp8``): which layers run FP8 GEMMs, what the GPU and the
shapes must allow, and the bytes Transformer Engine keeps for it. Torch-free.

Megatron-Core runs the linear layers of its transformer layers (QKV, output projection, MLP,
experts) under TE's FP8 autocast; the embedding, the output layer, the attention core
(scores, softmax, scores x values), norms, activations and the loss stay bf16.
``trainer.fp8.bf16_first_layers`` / ``bf16_last_layers`` keep whole layers at the ends of the
model in bf16 (Megatron-Core's ``first_last_layers_bf16``).
"""

from __future__ import annotations

from launcher.config import TrainwrightConfig, is_fp8
from launcher.core.problems import Problem
from launcher.plan.hardware import DEVICES, Device
from launcher.plan.params import layer_params
from launcher.shape.dims import ParallelDims
from launcher.shape.model import ResolvedModel

ALIGN = {"mxfp8": 32}
"""Every dimension of an FP8 GEMM must be a multiple of this (TE's ``assert_dim_for_fp8_exec``
for tensor scaling: rows of 8 and a last dimension of 16, which the transposed operands of the
backward GEMMs turn into 16 for all; MXFP8's 32-value blocks: 32; Megatron-Core's
``get_fp8_align_size`` says the same)."""
DEFAULT_ALIGN = 16

WEIGHT_COPY_BYTES = 2
"""Per GEMM weight of an FP8 layer: TE's FP8 copy of the bf16 weight and of its transpose
(Hopper's FP8 GEMMs take both operands K-major), cached from the first micro-batch of a step
to the last. With ``param_gather`` the weight itself is FP8 (1 byte, no bf16 copy) and only the
transpose is added: the same 2 bytes as a bf16 weight, so nothing extra."""
SCALING_VALUES_PER_GEMM = 5
"""fp32 scaling values per FP8 linear layer and amax history entry: forward input, weight and
output, backward output gradient and input gradient (TE's ``fp8_meta``)."""


def fp8_on(cfg: TrainwrightConfig) -> bool:
    return is_fp8(cfg.trainer.precision)


def layers_in_fp8(cfg: TrainwrightConfig) -> list[bool]:
    """Per transformer layer (global order): whether its GEMMs run in FP8."""
    n = cfg.model.num_layers
    if not fp8_on(cfg):
        return [False] * n
    first, last = cfg.trainer.fp8.bf16_first_layers, cfg.trainer.fp8.bf16_last_layers
    return [first <= i < n - last for i in range(n)]


def stage_fp8_layers(cfg: TrainwrightConfig, stage_layers) -> list[int]:
    """FP8 layers of every pipeline stage (``stage_layers``: layers per stage, first to last;
    virtual stages ignored, which moves bf16 end layers between stages at most)."""
    if not fp8_on(cfg):
        return [0] * len(stage_layers)
    flags, out, start = layers_in_fp8(cfg), [], 0
    for count in stage_layers:
        out.append(sum(flags[start:start + count]))
        start += count
    return out


def describe(cfg: TrainwrightConfig) -> str:
    """What runs in FP8, for the plan report ("" when precision is not fp8)."""
    if not fp8_on(cfg):
        return ""
    flags = layers_in_fp8(cfg)
    on = [i + 1 for i, f in enumerate(flags) if f]
    f = cfg.trainer.fp8
    span = f"layers {on[0]}-{on[-1]} of {len(flags)}" if on else "no layer"
    return (f"{span} ({f.recipe}, {f.format}): QKV, projection and MLP GEMMs; "
            "bf16: embedding, output layer, attention core, norms, loss")


def extra_state_bytes(cfg: TrainwrightConfig, d: ResolvedModel, dims: ParallelDims,
                      numbers) -> float:
    """Bytes TE keeps on one GPU for the FP8 layers among a stage's layers ``numbers`` (from
    0): weight copies (see WEIGHT_COPY_BYTES) and the scaling state (amax history of the
    delayed recipe) of each linear layer (:func:`linear_layers`)."""
    flags = layers_in_fp8(cfg)
    f = cfg.trainer.fp8
    history = f.amax_history_len if f.recipe == "delayed" else 1
    total = 0.0
    for kind, _ in d.layer_kinds(numbers):
        count = sum(1 for i in numbers if flags[i] and d.moe_layer(i) == (kind.experts > 0))
        if not count:
            continue
        layer = layer_params(kind, dims.tp, dims.ep)
        copies = 0 if f.param_gather else WEIGHT_COPY_BYTES * (layer.attention + layer.mlp
                                                               + layer.experts)
        scaling = linear_layers(kind, dims.ep) * SCALING_VALUES_PER_GEMM * max(history, 1) * 4
        total += count * (copies + scaling)
    return total


def linear_layers(d: ResolvedModel, ep: int) -> int:
    """TE linear layers of one layer on one GPU: QKV and projection (MLA: its down- and
    up-projections and the projection), and two per local expert, the shared expert or the
    dense MLP."""
    attention = (5 if d.q_lora else 4) if d.mla else 2
    if not d.experts:
        return attention + 2
    return attention + 2 * (d.experts // ep) + (2 if d.shared_ffn else 0)


def problems(cfg: TrainwrightConfig, dims: ParallelDims, device: Device | None) -> list[Problem]:
    """Every reason this machine and config cannot train in FP8, each with its fix."""
    if not fp8_on(cfg):
        return []
    out = _setting_problems(cfg, dims)
    if device is not None:
        out += _device_problems(cfg, device)
    return out + _shape_problems(cfg, dims, ResolvedModel.of(cfg.model, dims.tp))


def _device_problems(cfg: TrainwrightConfig, device: Device) -> list[Problem]:
    recipe = cfg.trainer.fp8.recipe
    if not device.peak_tflops_fp8:
        able = ", ".join(name for name, dev in DEVICES.items() if dev.peak_tflops_fp8)
        return [Problem(("trainer.precision", "cluster.gpu"),
                        f"trainer.precision=fp8 needs FP8 tensor cores; cluster.gpu="
                        f"{device.name} has none; use trainer.precision=bf16, or a cluster whose "
                        f"gpu has them ({able})")]
    if recipe == "mxfp8" and not device.mxfp8:
        able = ", ".join(name for name, dev in DEVICES.items() if dev.mxfp8)
        return [Problem(("trainer.fp8.recipe", "cluster.gpu"),
                        f"trainer.fp8.recipe=mxfp8 needs Blackwell tensor cores ({able}); "
                        f"cluster.gpu={device.name} has none; use trainer.fp8.recipe="
                        "tensorwise, delayed or blockwise")]
    return []


def _setting_problems(cfg: TrainwrightConfig, dims: ParallelDims) -> list[Problem]:
    f, n = cfg.trainer.fp8, cfg.model.num_layers
    out = []
    recipe = f.recipe
    if recipe == "delayed" and f.amax_history_len < 1:
        out.append(Problem(("trainer.fp8.amax_history_len",),
                           f"trainer.fp8.amax_history_len={f.amax_history_len} must be >= 1 "
                           "(steps of amax history), e.g. 1024"))
    first, last = f.bf16_first_layers, f.bf16_last_layers
    keys = ("trainer.fp8.bf16_first_layers", "trainer.fp8.bf16_last_layers")
    if first or last:
        per_stage = n // dims.pp
        if recipe == "delayed":
            out.append(Problem(keys + ("trainer.fp8.recipe",),
                               f"bf16 end layers (bf16_first_layers={first}, bf16_last_layers="
                               f"{last}) do not work with trainer.fp8.recipe=delayed (its amax "
                               "reduction spans the whole model); use recipe=tensorwise, or set "
                               "both to 0"))
        if min(first, last) < 0 or max(first, last) > per_stage:
            out.append(Problem(keys, f"bf16_first_layers={first} and bf16_last_layers={last} "
                                     f"must each be in 0..{per_stage} (model.num_layers / "
                                     f"pipeline_parallel_size = {n} / {dims.pp})"))
        elif first + last >= n:
            out.append(Problem(keys, f"bf16_first_layers + bf16_last_layers = {first + last} "
                                     f"leaves none of the {n} layers in FP8; use "
                                     "trainer.precision=bf16"))
    return out + _param_gather_problems(cfg)


def _param_gather_problems(cfg: TrainwrightConfig) -> list[Problem]:
    """FP8 weights replace the bf16 ones: trainwright's own weight writers (the layout-invariant
    init, trainer.init_from) copy bf16 values into them and were not tried on FP8 tensors."""
    t = cfg.trainer
    if not t.fp8.param_gather:
        return []
    out = []
    if t.layout_invariant_init and not t.init_from:
        out.append(Problem(("trainer.fp8.param_gather", "trainer.layout_invariant_init"),
                           "trainer.fp8.param_gather=true keeps the weights in FP8, which the "
                           "layout-invariant init does not write; set "
                           "trainer.layout_invariant_init=false (Megatron-Core's own init) or "
                           "trainer.fp8.param_gather=false"))
    if t.init_from:
        out.append(Problem(("trainer.fp8.param_gather", "trainer.init_from"),
                           "trainer.fp8.param_gather=true with trainer.init_from: loading bf16 "
                           "weights into FP8 parameters is not supported; start with "
                           "trainer.fp8.param_gather=false"))
    return out


def _shape_problems(cfg: TrainwrightConfig, dims: ParallelDims, d: ResolvedModel) -> list[Problem]:
    """Each GEMM dimension that breaks TE's alignment, named by the keys that set it."""
    recipe = cfg.trainer.fp8.recipe
    align = ALIGN.get(recipe, DEFAULT_ALIGN)
    out = []
    for keys, label, value in _gemm_dims(cfg, dims, d):
        if value % align:
            low, high = value // align * align, (value // align + 1) * align
            out.append(Problem(keys, f"trainer.precision=fp8 (recipe {recipe}) needs every FP8 "
                                     f"GEMM dimension divisible by {align}; {label} = {value} is "
                                     f"not (nearest multiples: {low}, {high}); change "
                                     f"{' or '.join(keys)} so that it is, or use "
                                     "trainer.precision=bf16"))
    return out


def _gemm_dims(cfg: TrainwrightConfig, dims: ParallelDims, d: ResolvedModel) -> list[tuple]:
    """(keys, how it is computed, value) of every distinct dimension of the FP8 GEMMs on one
    GPU: tokens of a micro-batch (rows; the K dimension of the weight-gradient GEMM), the
    hidden size, and the TP shards of QKV (or MLA's), projection and MLP widths (the experts',
    the shared expert's, a MoE model's dense first layers'). Expert token counts are padded to
    the alignment by Megatron-Core (``moe_router_padding_for_quantization``)."""
    tp, t = dims.tp, cfg.trainer
    tokens = t.micro_batch_size * d.seq // dims.cp
    return [
        (("trainer.micro_batch_size", "model.seq_length"),
         f"micro_batch_size x seq_length / context_parallel_size = {t.micro_batch_size} x "
         f"{d.seq} / {dims.cp}", tokens),
        (("model.hidden_size",), "model.hidden_size", d.hidden),
    ] + (_latent_dims(d, tp) if d.mla else _attention_dims(d, tp)) + _mlp_dims(d, tp)


TP_KEY = "parallelism.tensor_parallel_size"


def _attention_dims(d: ResolvedModel, tp: int) -> list[tuple]:
    heads = ("model.num_attention_heads", "model.kv_channels")
    return [
        (heads + (TP_KEY,), f"query width / TP = {d.q_dim} / {tp}", d.q_dim // tp),
        (("model.num_query_groups", "model.kv_channels", TP_KEY),
         f"(query + 2 x key/value width) / TP = ({d.q_dim} + 2 x {d.kv_dim}) / {tp}",
         (d.q_dim + 2 * d.kv_dim) // tp),
    ]


def _latent_dims(d: ResolvedModel, tp: int) -> list[tuple]:
    """MLA's GEMM widths: the latents (whole on every rank) and the TP shards of the query,
    key/value and output projections."""
    heads, rope = ("model.num_attention_heads", "model.kv_channels"), "model.qk_rope_head_dim"
    value = "model.v_head_dim"
    out = [(("model.q_lora_rank",), "model.q_lora_rank", d.q_lora)] if d.q_lora else []
    return out + [
        (("model.kv_lora_rank", rope), f"kv_lora_rank + qk_rope_head_dim = {d.kv_lora} + "
         f"{d.rope_dim}", d.kv_lora + d.rope_dim),
        (("model.kv_lora_rank",), "model.kv_lora_rank", d.kv_lora),
        (heads + (rope, TP_KEY), f"query width / TP = {d.q_dim} / {tp}", d.q_dim // tp),
        (heads + (value, TP_KEY), f"heads x (kv_channels + v_head_dim) / TP = {d.heads} x "
         f"({d.head_dim} + {d.v_dim}) / {tp}", d.heads * (d.head_dim + d.v_dim) // tp),
        (("model.num_attention_heads", value, TP_KEY),
         f"heads x v_head_dim / TP = {d.attention_out_dim} / {tp}", d.attention_out_dim // tp),
    ]


def _mlp_dims(d: ResolvedModel, tp: int) -> list[tuple]:
    widths = [(d.expert_ffn, "model.moe_ffn_hidden_size")] if d.experts else []
    if d.shared_ffn:
        widths.append((d.shared_ffn, "model.moe_shared_expert_ffn_hidden_size"))
    if not d.experts or d.dense_layers:
        widths.append((d.ffn, "model.ffn_hidden_size"))
    return [((key, TP_KEY), f"{key.split('.')[1]} / TP = {ffn} / {tp}", ffn // tp)
            for ffn, key in widths]
