"""The decoder block specs trainwright builds Megatron-Core's layers from, and the norms of ours
they use where Megatron-Core (0.16) has none: the one place that rewrites a layer spec.

- Sequence parallelism on the local (torch) layers: Megatron's ``WrappedTorchNorm`` refuses it,
  :class:`SequenceParallelTorchNorm` tags its parameters instead; query/key norms under it act on
  whole sequences, :class:`HeadTorchNorm`.
- OLMo 2 (``model.norm_placement=post``, ``model.qk_layernorm_all_heads``): no input norms; a norm
  on the output of attention and of the MLP before the residual add (:class:`RowParallelThenNorm`:
  the output projection, then the norm); query and key norms over all heads of a token, whose
  weights are split over TP with the heads (:class:`AllHeadsRMSNorm`). Built on the local layers
  (Transformer Engine's fuse the input norm into the QKV GEMM, which OLMo 2 does not have).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

__all__ = ["AllHeadsRMSNorm", "HeadTorchNorm", "RowParallelThenNorm", "SequenceParallelTorchNorm",
           "block_spec"]


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

    def __new__(cls, *args, **kwargs):
        return _row_parallel_then_norm()(*args, **kwargs)


@functools.cache
def _row_parallel_then_norm() -> type:
    from megatron.core.tensor_parallel import RowParallelLinear

    class RowParallelLinearThenNorm(RowParallelLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            config = kwargs["config"]
            self.post_norm = SequenceParallelTorchNorm(config, self.output_size,
                                                       config.layernorm_epsilon)

        def forward(self, x, *args, **kwargs):
            out, bias = super().forward(x, *args, **kwargs)
            assert bias is None, "a post-norm follows a linear without bias"
            return self.post_norm(out), None

    return RowParallelLinearThenNorm


def _post_norm_layer(spec, all_heads: bool):
    """A dense local layer spec rewritten for OLMo 2."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = spec.submodules.self_attention
    attn_subs = dataclasses.replace(attention.submodules, linear_proj=RowParallelThenNorm)
    if all_heads:
        attn_subs = dataclasses.replace(
            attn_subs, q_layernorm=ModuleSpec(module=AllHeadsRMSNorm, params={"kind": "query"}),
            k_layernorm=ModuleSpec(module=AllHeadsRMSNorm, params={"kind": "key"}))
    mlp = spec.submodules.mlp
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(
        mlp.submodules, linear_fc2=RowParallelThenNorm))
    subs = dataclasses.replace(
        spec.submodules, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp,
        self_attention=dataclasses.replace(attention, submodules=attn_subs), mlp=mlp,
        sharded_state_dict_keys_map={})
    return dataclasses.replace(spec, submodules=subs)


def _with_sp_norms(block_spec):
    """Swap the local norms of a block spec for :class:`SequenceParallelTorchNorm` (the QK
    norms, when the spec has them, for :class:`HeadTorchNorm`)."""
    from megatron.core.transformer.identity_op import IdentityOp

    layers = []
    for spec in block_spec.layer_specs:
        attention = spec.submodules.self_attention
        heads = getattr(attention.submodules, "q_layernorm", IdentityOp)
        if heads is not IdentityOp and getattr(heads, "module", None) is not AllHeadsRMSNorm:
            attention = dataclasses.replace(attention, submodules=dataclasses.replace(
                attention.submodules, q_layernorm=HeadTorchNorm, k_layernorm=HeadTorchNorm))
        subs = dataclasses.replace(spec.submodules, self_attention=attention)
        if spec.submodules.input_layernorm is not IdentityOp:
            subs = dataclasses.replace(subs, input_layernorm=SequenceParallelTorchNorm,
                                       pre_mlp_layernorm=SequenceParallelTorchNorm)
        layers.append(dataclasses.replace(spec, submodules=subs))
    return dataclasses.replace(block_spec, layer_specs=layers,
                               layer_norm=SequenceParallelTorchNorm)


def block_spec(config, vp_stage: Optional[int], *, use_te: bool, post_norm: bool = False,
               qk_all_heads: bool = False):
    """Layer specs of this pipeline stage (dense or MoE), Transformer Engine's or local; with
    ``post_norm`` (OLMo 2) local, rewritten as :func:`_post_norm_layer`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = use_te and not post_norm
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization, vp_stage=vp_stage
    )
    if post_norm:
        spec = dataclasses.replace(spec, layer_specs=[
            _post_norm_layer(layer, qk_all_heads) for layer in spec.layer_specs])
    if not use_te and config.sequence_parallel:
        spec = _with_sp_norms(spec)
    return spec
