"""Model FLOPs per token, the numerator of MFU.

Counts the matrix multiplications of one token's forward pass (2 FLOPs per multiply-add): QKV and
output projections, attention scores and weighted values over the full sequence (the convention of
Narayanan et al. 2021 and PaLM's MFU, causal masking not discounted), the MLP or the top-k experts,
router and shared expert, and the output layer over the padded vocabulary. Multi-latent attention
counts its down- and up-projections, keys of head_dim + qk_rope_head_dim and values of v_head_dim;
a MoE model's dense first layers count a dense MLP. Training is 3x forward; activation
recompute adds hardware FLOPs but not model FLOPs, so MFU ignores it.

``causal=True`` counts half of the attention scores and weighted values (a causal mask computes
only the lower triangle), as Megatron-LM's and NeMo's logged TFLOP/s do: the figure to compare
with those logs (``mfu_causal``). ``mfu`` stays the full-attention one (PaLM, torchtitan).

A sliding window of W tokens (``model.window_size``) bounds the keys of every query: W instead
of the sequence in the full convention, and W - W^2 / (2 s) on average under the causal mask
(s / 2 when W reaches the sequence). With full-attention layers among the windowed ones
(``model.full_attention_every``) the keys are averaged over the layers.
"""

from __future__ import annotations

from launcher.shape.model import ResolvedModel


def forward_flops_per_token(d: ResolvedModel, causal: bool = False) -> float:
    keys = attended_keys(d, causal)
    layers = sum(n * (attention_flops(kind, keys) + mlp_flops(kind))
                 for kind, n in d.layer_kinds(range(d.layers)))
    return layers + 2 * d.hidden * d.padded_vocab  # + the output layer


def attention_flops(d: ResolvedModel, keys: float) -> float:
    """One token's attention in one layer over ``keys`` keys: its projections, then QK^T
    (key width: head_dim, + the rotated part with MLA) and scores x V (value width)."""
    if d.mla:
        return latent_projection_flops(d) + 2 * keys * (d.q_dim + d.attention_out_dim)
    attn_linear = 2 * d.hidden * (d.q_dim + 2 * d.kv_dim) + 2 * d.q_dim * d.hidden
    return attn_linear + 2 * 2 * keys * d.q_dim  # QK^T and scores x V


def latent_projection_flops(d: ResolvedModel) -> int:
    """MLA's matmuls for one token: the query down- and up-projection (or one projection from
    the hidden state), the key/value down-projection (latent + the shared rotated key) and
    up-projection (each head's unrotated key and value), the output projection."""
    if d.q_lora:
        query = 2 * d.hidden * d.q_lora + 2 * d.q_lora * d.q_dim
    else:
        query = 2 * d.hidden * d.q_dim
    key_value = 2 * d.hidden * (d.kv_lora + d.rope_dim)
    key_value += 2 * d.kv_lora * d.heads * (d.head_dim + d.v_dim)
    return query + key_value + 2 * d.attention_out_dim * d.hidden


def mlp_flops(d: ResolvedModel) -> int:
    """One token's MLP in one layer: the dense MLP, or the router, the top-k experts and the
    shared expert."""
    matrices = 3 if d.gated else 2
    if d.experts:
        mlp = d.topk * 2 * matrices * d.hidden * d.expert_ffn + 2 * d.hidden * d.experts
        return mlp + 2 * matrices * d.hidden * d.shared_ffn
    return 2 * matrices * d.hidden * d.ffn


def attended_keys(d: ResolvedModel, causal: bool) -> float:
    """Keys a query's scores are computed over, on average over the layers (module
    docstring); full-attention layers between windowed ones attend over the sequence."""
    windowed = d.windowed_layers
    keys = _keys(min(d.window, d.seq), d.seq, causal) if windowed else 0.0
    full = _keys(d.seq, d.seq, causal)
    return (windowed * keys + (d.layers - windowed) * full) / d.layers


def _keys(window: int, seq: int, causal: bool) -> float:
    return float(window) if not causal else window - window * window / (2 * seq)


def train_flops_per_token(d: ResolvedModel, causal: bool = False) -> float:
    """Forward + backward (backward = 2x forward)."""
    return 3 * forward_flops_per_token(d, causal)
