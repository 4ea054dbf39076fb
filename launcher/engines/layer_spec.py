"""The decoder block specs trainwright builds Megatron-Core's layers from, and the norms of ours
they use where Megatron-Core (0.16) has none: the one place that rewrites a layer spec.

- Sequence parallelism on the local (torch) layers: Megatron's ``WrappedTorchNorm`` refuses it,
  :class:`SequenceParallelTorchNorm` tags its parameters instead; query/key norms under it act on
  whole sequences, :class:`HeadTorchNorm`.
- OLMo 2 (``model.norm_placement=post``, ``model.qk_layernorm_all_heads``): no input norms; a norm
  on the output of attention and of the MLP before the residual add (:class:`RowParallelThenNorm`:
  the output projection, then the norm); query and key norms over all heads of a token, whose
  weights are split over TP with the heads (:class:`AllHeadsRMSNorm`).
- Gemma 3 (``model.norm_placement=pre_post``, ``model.norm_zero_centered``,
  ``model.rotary_base_local``): norms on both sides of attention and MLP, each multiplying by
  1 + weight (:class:`ZeroCenteredRMSNorm`); the sliding-window layers rotate with a RoPE base of
  their own (:class:`LocalRopeSelfAttention`).
- Sliding windows (``model.window_size``) on the local layers: the window is combined with the
  mask the attention is given (packed conversations), :class:`WindowedDotProductAttention`.
- DeepSeek-V3 (``model.kv_lora_rank``): Megatron-Core's local multi-latent-attention layers, their
  norms saved under Transformer Engine's names and tagged under sequence parallelism.

Models that need any of these are built on the local layers, GPU included (Transformer Engine's
spec fuses the input norms into the QKV and first MLP linears; a TE variant is left for a GPU
session).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from launcher.shape import ResolvedModel

__all__ = ["AllHeadsRMSNorm", "HeadTorchNorm", "LatentDotProductAttention", "LatentSelfAttention",
           "LocalRopeSelfAttention", "RowParallelThenNorm", "WindowedDotProductAttention",
           "SequenceParallelTorchNorm", "ZeroCenteredRMSNorm", "block_spec"]


def _torch_norm(config, hidden_size: int, eps: float) -> torch.nn.Module:
    norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
    return norm_cls(hidden_size, eps=eps)


class SequenceParallelTorchNorm:
    """torch LayerNorm/RMSNorm whose parameters are tagged ``sequence_parallel``.

    Megatron's local WrappedTorchNorm refuses sequence parallelism because it does not tag its
    parameters; finalize_model_grads all-reduces the grads of tagged parameters across the TP group
    (as TENorm and FusedLayerNorm do), which is all sequence parallelism needs from a norm.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = _torch_norm(config, hidden_size, eps)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


class HeadTorchNorm:
    """torch RMSNorm/LayerNorm for the query and key norms under sequence parallelism: they act
    on whole sequences (after the all-gather) of this rank's heads, so they are not
    sequence-parallel, which Megatron's local WrappedTorchNorm asserts of every norm. Their
    gradients are summed over the TP group by name (finalize_model_grads; the DeepSpeed
    engine's hook)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        return _torch_norm(config, hidden_size, eps)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm that multiplies by 1 + weight, the weight starting at 0 (Gemma's norms;
    Megatron-Core's local norm refuses layernorm_zero_centered_gamma). Computed in fp32 and
    cast back, as Hugging Face's Gemma3RMSNorm. A hidden-size norm is tagged sequence-parallel
    under SP; a query/key norm (``heads``) is not (it sees whole sequences of its heads, and its
    gradient is summed over TP by name)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, heads: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        if not heads:
            setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class AllHeadsRMSNorm(torch.nn.Module):
    """RMSNorm of a token's queries (or keys) over all heads at once, as OLMo 2's q_norm/k_norm
    before the heads are split. This rank holds some heads ``[s, b, heads, head_dim]``; the sum
    of squares is summed over the TP group (autograd's all-reduce, whose backward sums the
    gradients too), and the weight is this rank's heads' slice of the whole, TP-sharded on dim 0
    in checkpoints. ``kind``: "query" or "key"."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, kind: str = "query"):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.tp = config.tensor_model_parallel_size
        heads = config.num_attention_heads if kind == "query" else config.num_query_groups
        self.width = heads * hidden_size  # all heads, all ranks
        self.eps = eps
        self.group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.weight = torch.nn.Parameter(torch.ones(self.width // self.tp,
                                                    dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], shape[-2] * shape[-1]).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.group is not None:
            squares = torch.distributed.nn.functional.all_reduce(squares, group=self.group)
        normed = flat * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight.float() * normed).to(x.dtype).view(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


class RowParallelThenNorm:
    """Megatron-Core's RowParallelLinear (attention's output projection, the MLP's second
    linear) followed by a norm over the hidden size: OLMo 2's post-attention and post-MLP norms,
    applied before the residual add. The norm is ``.post_norm`` of the linear; under sequence
    parallelism it sees this rank's slice of the sequence and is tagged so."""

    def __new__(cls, *args, zero_centered: bool = False, **kwargs):
        return _row_parallel_then_norm()(*args, zero_centered=zero_centered, **kwargs)


@functools.cache
def _row_parallel_then_norm() -> type:
    from megatron.core.tensor_parallel import RowParallelLinear

    class RowParallelLinearThenNorm(RowParallelLinear):
        def __init__(self, *args, zero_centered: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            config = kwargs["config"]
            norm = ZeroCenteredRMSNorm if zero_centered else SequenceParallelTorchNorm
            self.post_norm = norm(config, self.output_size, config.layernorm_epsilon)

        def forward(self, x, *args, **kwargs):
            out, bias = super().forward(x, *args, **kwargs)
            assert bias is None, "a post-norm follows a linear without bias"
            return self.post_norm(out), None

    return RowParallelLinearThenNorm


class LocalRopeSelfAttention:
    """Megatron-Core's SelfAttention whose sliding-window layers rotate queries and keys with a
    RoPE of their own base (Gemma 3: 10,000 local, 1,000,000 global; the model's RoPE, scaling
    included, stays the full-attention layers'). Which layers are windowed is Megatron-Core's
    own rule (``is_layer_window_attention``), as its attention applies the window. Built for
    whole sequences on one context-parallel rank (a window with CP is refused)."""

    def __new__(cls, *args, rotary_base_local: int, **kwargs):
        return _local_rope_attention()(*args, rotary_base_local=rotary_base_local, **kwargs)


@functools.cache
def _local_rope_attention() -> type:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.utils import is_layer_window_attention

    class SelfAttentionWithLocalRope(SelfAttention):
        def __init__(self, config, *args, rotary_base_local: int, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.local_rope = None
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                         self.layer_number):
                self.local_rope = RotaryEmbedding(
                    kv_channels=config.kv_channels, rotary_percent=1.0,
                    rotary_base=rotary_base_local,
                    use_cpu_initialization=config.use_cpu_initialization)

        def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
            if self.local_rope is not None and rotary_pos_emb is not None:
                rotary_pos_emb = self.local_rope(rotary_pos_emb.shape[0])
            return super().forward(hidden_states, attention_mask, *args,
                                   rotary_pos_emb=rotary_pos_emb, **kwargs)

    return SelfAttentionWithLocalRope


def _rewritten_layer(spec, r: ResolvedModel):
    """A dense local layer spec as ``r`` places and weighs its norms (OLMo 2, Gemma 3)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    centered = r.zero_centered
    hidden = ZeroCenteredRMSNorm if centered else SequenceParallelTorchNorm
    attention, mlp, subs = (spec.submodules.self_attention, spec.submodules.mlp,
                            spec.submodules)
    attn_subs = attention.submodules
    if r.post_norm:
        then_norm = ModuleSpec(module=RowParallelThenNorm, params={"zero_centered": centered})
        attn_subs = dataclasses.replace(attn_subs, linear_proj=then_norm)
        mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(
            mlp.submodules, linear_fc2=then_norm))
    if r.qk_all_heads:
        attn_subs = dataclasses.replace(
            attn_subs, q_layernorm=ModuleSpec(module=AllHeadsRMSNorm, params={"kind": "query"}),
            k_layernorm=ModuleSpec(module=AllHeadsRMSNorm, params={"kind": "key"}))
    elif r.qk_norm:
        heads = ModuleSpec(module=ZeroCenteredRMSNorm, params={"heads": True}) if centered \
            else HeadTorchNorm
        attn_subs = dataclasses.replace(attn_subs, q_layernorm=heads, k_layernorm=heads)
    attention = dataclasses.replace(attention, submodules=attn_subs)
    if r.rotary_base_local:
        attention = dataclasses.replace(attention, module=LocalRopeSelfAttention, params={
            **attention.params, "rotary_base_local": r.rotary_base_local})
    if r.pre_norm:
        subs = dataclasses.replace(subs, input_layernorm=hidden, pre_mlp_layernorm=hidden)
    else:
        subs = dataclasses.replace(subs, input_layernorm=IdentityOp,
                                   pre_mlp_layernorm=IdentityOp, sharded_state_dict_keys_map={})
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        subs, self_attention=attention, mlp=mlp))


def _with_sp_norms(block_spec):
    """Swap the local norms of a block spec for :class:`SequenceParallelTorchNorm` (the QK
    norms, when the spec has them, for :class:`HeadTorchNorm`)."""
    from megatron.core.transformer.identity_op import IdentityOp

    layers = []
    for spec in block_spec.layer_specs:
        attention = spec.submodules.self_attention
        heads = getattr(attention.submodules, "q_layernorm", IdentityOp)
        if heads is not IdentityOp:
            attention = dataclasses.replace(attention, submodules=dataclasses.replace(
                attention.submodules, q_layernorm=HeadTorchNorm, k_layernorm=HeadTorchNorm))
        subs = dataclasses.replace(spec.submodules, self_attention=attention,
                                   input_layernorm=SequenceParallelTorchNorm,
                                   pre_mlp_layernorm=SequenceParallelTorchNorm)
        layers.append(dataclasses.replace(spec, submodules=subs))
    return dataclasses.replace(block_spec, layer_specs=layers,
                               layer_norm=SequenceParallelTorchNorm)


class LatentDotProductAttention:
    """Megatron-Core's local attention for multi-latent attention, whose values are narrower or
    wider than its keys: 0.16's MLA passes ``k_channels``/``v_channels``, which only Transformer
    Engine's attention accepts; the local one sizes its output by kv_channels (the key width)."""

    def __new__(cls, *args, k_channels: int = 0, v_channels: int = 0, **kwargs):
        # Attention.__init__ builds one without the widths, which MLA then replaces
        return _latent_dot_product_attention()(*args, v_channels=v_channels, **kwargs)


@functools.lru_cache(maxsize=None)
def _latent_dot_product_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class _Latent(DotProductAttention):
        def __init__(self, config, *args, v_channels: int, **kwargs):
            super().__init__(config, *args, **kwargs)
            if v_channels:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return _Latent


class LatentSelfAttention:
    """Megatron-Core's multi-latent attention with its key/value down-projection replicated on
    the TP ranks (Megatron-Core's local ``Linear``, as Transformer Engine's spec duplicates it),
    and the gradient of the rotated key summed over TP without sequence parallelism.

    Megatron-Core 0.16's local spec splits that projection over TP (ColumnParallelLinear) and
    gathers its output: in backward each rank then keeps the gradient of its own columns, and the
    rotated key's columns, which every head reads, carry only the heads of one rank (TP=2 trains
    another model than TP=1). Replicated, the rotated key is gathered along the sequence under
    SP (its backward sums over TP) or, without SP, passes an identity whose backward all-reduces
    (:func:`_sum_rotated_key_grads`)."""

    def __new__(cls, config, *args, **kwargs):
        return _latent_self_attention()(config, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _latent_self_attention() -> type:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class _LatentSelfAttention(MLASelfAttention):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if self.pg_collection.tp.size() > 1 and not config.sequence_parallel:
                self.linear_kv_down_proj.register_forward_hook(
                    _sum_rotated_key_grads(config.kv_lora_rank))

    return _LatentSelfAttention


class _SumGradsOverTensorParallel(torch.autograd.Function):
    """Identity whose backward all-reduces the gradient over the TP group. (Megatron-Core's
    copy_to_tensor_model_parallel_region reduces ``grad.contiguous()`` and returns ``grad``: a
    gradient that arrives as a strided slice, as a column block's does, is left unreduced.)"""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        from megatron.core import parallel_state

        from launcher.parallel import collectives

        return collectives.sum_(grad.contiguous(),
                                group=parallel_state.get_tensor_model_parallel_group())


def _sum_rotated_key_grads(kv_lora_rank: int):
    """A forward hook on the replicated key/value down-projection: its rotated-key columns
    pass an identity whose backward all-reduces over TP (each rank's heads' share)."""
    def hook(_module, _inputs, output):
        out, bias = output
        latent, rotated = out[..., :kv_lora_rank], out[..., kv_lora_rank:]
        return torch.cat([latent, _SumGradsOverTensorParallel.apply(rotated)], -1), bias
    return hook


class WindowedDotProductAttention:
    """Megatron-Core's local attention whose sliding window is ANDed with the mask it is given:
    0.16's masked softmax replaces any given mask by the window's when the layer is windowed
    (fused_softmax.py forward_torch_softmax), so packed conversations attended across their
    boundaries; without a given mask this is the window's, as before."""

    def __new__(cls, *args, **kwargs):
        return _windowed_dot_product_attention()(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _windowed_dot_product_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    class _Windowed(DotProductAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._window = self.scale_mask_softmax.window_size
            self.scale_mask_softmax.window_size = None  # the mask below carries it

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            if self._window is not None:
                window = get_sliding_window_causal_mask(query.size(0), key.size(0), self._window)
                window = window.to(query.device)
                attention_mask = window if attention_mask is None else attention_mask | window
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return _Windowed


def _with_windowed_attention(spec):
    """A block spec whose local attention keeps the given mask inside the window."""
    layers = []
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, core_attention=WindowedDotProductAttention))
        layers.append(dataclasses.replace(layer, submodules=dataclasses.replace(
            layer.submodules, self_attention=attention)))
    return dataclasses.replace(spec, layer_specs=layers)


MLA_KEYS = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
            "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
"""Where Transformer Engine's MLA spec keeps the latent norms (fused into the up-projections):
the local layers save them under the same names, so a checkpoint loads on either."""


def _latent_attention_layer(spec, sequence_parallel: bool):
    """A local multi-latent-attention layer spec saving its norms under Transformer Engine's
    names (:data:`MLA_KEYS`; a dense layer's pre-MLP norm as the first MLP linear's, a MoE
    layer's as ``pre_mlp_layernorm``, as TE's spec has them); under sequence parallelism every
    norm, the latent ones included (they see this rank's part of the sequence), tagged."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron.core.post_training.modelopt.layers import Linear

    subs = spec.submodules
    attention = subs.self_attention
    subs = dataclasses.replace(subs, self_attention=dataclasses.replace(
        attention, module=LatentSelfAttention, submodules=dataclasses.replace(
            attention.submodules, core_attention=LatentDotProductAttention,
            linear_kv_down_proj=Linear)))
    keys = dict(MLA_KEYS)
    if subs.mlp.module is not MoELayer:
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    if sequence_parallel:
        attention = subs.self_attention
        latent = {name: SequenceParallelTorchNorm for name in ("q_layernorm", "kv_layernorm")}
        subs = dataclasses.replace(
            subs, input_layernorm=SequenceParallelTorchNorm,
            pre_mlp_layernorm=SequenceParallelTorchNorm,
            self_attention=dataclasses.replace(attention, submodules=dataclasses.replace(
                attention.submodules, **latent)))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        subs, sharded_state_dict_keys_map=keys))


def block_spec(config, vp_stage: Optional[int], *, use_te: bool, r: ResolvedModel):
    """Layer specs of this pipeline stage (dense or MoE), Transformer Engine's or local; a
    model that needs our norms or RoPE (``r.local_layers``) is built from rewritten local
    specs, whose norms tag themselves for sequence parallelism."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    rewrite = r.local_layers
    use_te = use_te and not rewrite
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization, vp_stage=vp_stage
    )
    if r.window and not use_te:
        spec = _with_windowed_attention(spec)
    if rewrite:
        final = ZeroCenteredRMSNorm if r.zero_centered else SequenceParallelTorchNorm
        return dataclasses.replace(spec, layer_norm=final, layer_specs=[
            _rewritten_layer(layer, r) for layer in spec.layer_specs])
    if not use_te and r.mla:
        final = SequenceParallelTorchNorm if config.sequence_parallel else spec.layer_norm
        return dataclasses.replace(spec, layer_norm=final, layer_specs=[
            _latent_attention_layer(layer, config.sequence_parallel)
            for layer in spec.layer_specs])
    if not use_te and config.sequence_parallel:
        spec = _with_sp_norms(spec)
    return spec
